"""One host -> device staging path (engine_svc/worker/staging.py) and the sampling columns it carries
(engine_svc/sample/columns.py), on CPU. `copy=True` runs the CUDA path's copying with CPU tensors, so the
values that reach the "device" and the copies issued can be checked without a GPU."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch

from engine_svc.sample.columns import SamplingColumns
from engine_svc.sample.metadata import RequestSamplingState, build_sampling_metadata, step_sampling_params
from engine_svc.worker.input_batch import InputBatch, StepInputs
from engine_svc.worker.staging import PAD_SLOT, StepStaging
from entrypoints import LLM, SamplingParams
from shared_runtime.contract import EngineSamplingParams

CPU = torch.device("cpu")


def _staging(copy: bool = True, max_reqs: int = 8) -> StepStaging:
    return StepStaging(CPU, max_tokens=32, max_reqs=max_reqs, max_blocks_per_req=5, copy=copy)


def _batch_with(reqs: dict[str, tuple[int, int]], block_size: int = 4) -> InputBatch:
    """An InputBatch holding requests name -> (num tokens known, num computed), blocks 10, 11, ..."""
    batch = InputBatch(max_num_reqs=8, max_model_len=20, block_size=block_size)
    next_block = 10
    for name, (num_tokens, num_computed) in reqs.items():
        nb = -(-num_tokens // block_size)
        batch.add(name, [100 + 7 * len(batch.row_of) + i for i in range(num_tokens)],
                  list(range(next_block, next_block + nb)), num_computed)
        next_block += nb
    return batch


def _three_decodes() -> StepInputs:
    batch = _batch_with({"a": (6, 5), "b": (9, 8), "c": (2, 1)})  # blocks: a 10, 11; b 12-14; c 15
    return batch.prepare({"a": 1, "b": 1, "c": 1})


# ---- step inputs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("copy", [True, False])
def test_staged_inputs_equal_the_step_arrays(copy: bool) -> None:
    batch = _batch_with({"a": (6, 5), "b": (9, 8), "c": (7, 0)})
    inputs = batch.prepare({"a": 1, "b": 1, "c": 7})  # two decodes and a prefill
    staging = _staging(copy)
    staged = staging.stage_inputs(inputs)
    assert staged.input_ids.tolist() == inputs.input_ids.tolist()
    assert staged.positions.tolist() == inputs.positions.tolist()
    assert staged.slot_mapping.tolist() == inputs.slot_mapping.tolist()
    assert staged.query_start_loc.tolist() == inputs.query_start_loc.tolist() == [0, 1, 2, 9]
    assert staged.seq_lens.tolist() == inputs.seq_lens.tolist()
    assert (staged.query_start_loc.dtype, staged.seq_lens.dtype, staged.block_table.dtype) == (torch.int32,) * 3
    width = inputs.block_table.shape[1]
    assert staged.block_table.shape == (3, 5)  # whole rows of the served max_model_len's width
    assert staged.block_table[:, :width].tolist() == inputs.block_table.tolist()
    assert staging.num_copies == (4 if copy else 0)  # tokens (one [3, T] block), qsl, seq_lens, block table


def test_buffers_persist_across_steps() -> None:
    """No per-step allocation: every step's device views share the same storage."""
    staging = _staging()
    first = staging.stage_inputs(_three_decodes())
    second = staging.stage_inputs(_batch_with({"x": (4, 3)}).prepare({"x": 1}))
    for a, b in zip(fields(first), fields(second)):
        if getattr(first, a.name) is None:  # group_slots: no hybrid KV groups here
            continue
        assert getattr(first, a.name).data_ptr() == getattr(second, b.name).data_ptr()
    assert second.input_ids.tolist() == [100 + 3] and second.seq_lens.tolist() == [4]


def test_buffers_start_as_dummy_requests() -> None:
    staging = _staging()
    meta = staging.graph_metadata(8, max_seq_len=20)
    assert meta.slot_mapping.tolist() == [PAD_SLOT] * 8
    assert meta.seq_lens.tolist() == [1] * 8
    assert meta.query_start_loc.tolist() == list(range(9))
    assert meta.block_table.shape == (8, 5) and not meta.block_table.any()


def test_graph_padding_in_place() -> None:
    step = _three_decodes()
    staging = _staging()
    four = _batch_with({"w": (9, 8), "x": (10, 9), "y": (11, 10), "z": (12, 11)})
    staging.stage_inputs(four.prepare(dict.fromkeys("wxyz", 1)))  # row 3 now holds a real request
    staged = staging.stage_inputs(step, pad_to=4)
    assert staged.input_ids.tolist() == [*step.input_ids.tolist(), 0]
    assert staged.positions.tolist() == [5, 8, 1, 0]
    assert staged.slot_mapping.tolist() == [11 * 4 + 1, 14 * 4 + 0, 15 * 4 + 1, PAD_SLOT]
    assert staged.seq_lens.tolist() == [6, 9, 2, 1]
    assert staged.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # the blocks attention reads (the first ceil(seq_len / block_size) of each row; the rest may be stale)
    read = [row[: -(-n // 4)] for row, n in zip(staged.block_table.tolist(), [6, 9, 2, 1])]
    assert read == [[10, 11], [12, 13, 14], [15], [0]]
    meta = staging.graph_metadata(4, max_seq_len=20)
    assert meta.seq_lens.tolist() == [6, 9, 2, 1]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_decodes, meta.num_reqs) == (1, 20, 4, 4)
    # Views, not copies: the next step's staging is what a captured graph reads.
    assert meta.seq_lens.data_ptr() == staged.seq_lens.data_ptr() == staging.seq_lens.device.data_ptr()


def test_graph_padding_refuses_prefill_and_overflow() -> None:
    batch = _batch_with({"a": (6, 5), "c": (3, 0)})
    with pytest.raises(ValueError, match="decode-only"):
        _staging().stage_inputs(batch.prepare({"a": 1, "c": 3}), pad_to=4)
    with pytest.raises(ValueError, match="at most 2"):
        _staging().stage_inputs(_three_decodes(), pad_to=2)


def test_variable_arrays_pack_per_dtype_and_grow() -> None:
    staging = _staging()
    a, b, c = np.arange(5, dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3), np.array([7, 8])
    ta, tb, tc = staging.stage_arrays([a, b, c])
    assert ta.tolist() == a.tolist() and tb.tolist() == b.tolist() and tc.tolist() == c.tolist()
    assert (ta.dtype, tb.dtype, tc.dtype) == (torch.int64, torch.int32, torch.int64)
    assert staging.num_copies == 2  # one per dtype
    (big,) = staging.stage_arrays([np.arange(5000, dtype=np.int64)])  # past the initial capacity
    assert big.tolist() == list(range(5000))


# ---- sampling parameters as per-row columns ------------------------------------------------------
VOCAB = 50


def _state(**params: object) -> RequestSamplingState:
    return RequestSamplingState(EngineSamplingParams(**params), [1, 2, 3], [0], VOCAB, output_token_ids=[4, 4])


MIXES = {
    "random": [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_p=0.8, min_p=0.1)],
    "greedy and random": [dict(temperature=0.0), dict(temperature=0.5, top_k=VOCAB + 3), dict(temperature=2.0)],
    "all greedy": [dict(temperature=0.0, presence_penalty=0.5), dict(temperature=0.0, min_tokens=5)],
    "penalties and min_tokens": [dict(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.3),
                                 dict(temperature=0.6, min_tokens=9, top_p=0.5)],
    "logit bias": [dict(temperature=0.0, logit_bias={3: 1.5, 7: -2.0}), dict(temperature=0.4, logit_bias={9: 4.0})],
    "token filters": [dict(temperature=0.0, allowed_token_ids=[3, 9, 11]),
                      dict(temperature=0.7, bad_words_token_ids=[[4, 8], [6]], allowed_token_ids=[2])],
}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.tolist() == b.tolist()
    return a == b


@pytest.mark.parametrize("mix", list(MIXES))
def test_columns_give_the_old_paths_values(mix: str) -> None:
    states = [_state(**p) for p in MIXES[mix]]
    staging = _staging()
    columns = SamplingColumns(8, staging)
    rows = np.array([5, 1, 6][: len(states)], dtype=np.int64)  # any rows of the persistent batch
    for row, s in zip(rows, states):
        columns.set_row(int(row), s)
    old, new = step_sampling_params(states, CPU), columns.params_for(rows)
    for f in fields(old):
        assert _same(getattr(old, f.name), getattr(new, f.name)), f.name
    # The whole metadata too, with the per-step arrays (penalties, min_tokens) through the staging.
    old_meta = build_sampling_metadata(states, CPU)
    new_meta = build_sampling_metadata(states, CPU, columns=columns, rows=rows, stage=staging.stage_arrays)
    for f in fields(old_meta):
        a, b = getattr(old_meta, f.name), getattr(new_meta, f.name)
        if f.name == "penalties" and a is not None:
            assert all(_same(getattr(a, g.name), getattr(b, g.name)) for g in fields(a))
        elif f.name in ("min_tokens_mask", "logit_bias", "allowed_token_ids", "bad_words_mask") and a is not None:
            assert all(_same(x, y) for x, y in zip(a, b))
        else:
            assert _same(a, b), f.name


def test_a_steady_batch_copies_nothing_and_a_changed_one_recopies() -> None:
    staging = _staging()
    columns = SamplingColumns(8, staging)
    states = [_state(temperature=0.7, top_k=3), _state(temperature=0.0), _state(temperature=1.1, top_p=0.9)]
    for row, s in enumerate(states):
        columns.set_row(row, s)
    rows = np.array([0, 1, 2], dtype=np.int64)
    first = columns.params_for(rows)
    copies = staging.num_copies
    assert copies == 4  # temperature, greedy rows, top_k, top_p
    for _ in range(5):  # steady decoding: the same rows in the same order
        assert columns.params_for(rows.copy()) is first
    assert staging.num_copies == copies and columns.num_gathers == 1

    columns.set_row(1, _state(temperature=0.3, min_p=0.2))  # row 1's request left, a new one took the row
    again = columns.params_for(rows)  # the same rows, but one of them rewritten
    assert columns.num_gathers == 2 and again is not first
    assert again.greedy_rows is None and again.min_p is not None and again.min_p.tolist()[1] == pytest.approx(0.2)
    copies = staging.num_copies
    columns.params_for(np.array([0, 2], dtype=np.int64))  # a request left the step
    assert columns.num_gathers == 3 and staging.num_copies == copies + 3  # temperature, top_k, top_p


def test_the_runner_gathers_once_per_batch_change(make_model) -> None:
    """Three random-sampling requests decoding together, finishing one after another: one gather when
    they join, one each time one leaves; nothing in the steady steps between."""
    llm = LLM(str(make_model("llama")), dtype="float32")
    runner = llm.engine.executor.worker.runner  # type: ignore[attr-defined]
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate((3, 6, 10))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 6, 10]
    assert runner.sampling_columns.num_gathers == 3
    llm.engine.shutdown()


# ---- async scheduling: two host sets, and the placeholder fill ------------------------------------------
def test_double_buffered_steps_alternate_host_arrays_and_stage_the_same_values() -> None:
    staging = StepStaging(CPU, max_tokens=32, max_reqs=8, max_blocks_per_req=5, copy=True, double_buffered=True)
    single = _staging()
    hosts = []
    for step in [_three_decodes(), _batch_with({"x": (4, 3)}).prepare({"x": 1}), _three_decodes()]:
        for s in (staging, single):
            s.begin_step()
            staged = s.stage_inputs(step, pad_to=4)
            s.end_step()
            assert staged.input_ids.tolist()[: len(step.req_ids)] == step.input_ids.tolist()
        hosts.append(staging.tokens.host_tensor.data_ptr())
        assert staging.tokens.device.tolist() == single.tokens.device.tolist()  # padding included
        assert staging.seq_lens.device[:4].tolist() == single.seq_lens.device[:4].tolist()
    assert hosts[0] != hosts[1] == hosts[1] and hosts[0] == hosts[2]  # step N+1 writes the other set
    # Both sets started as dummy requests (a graph replay pads from them).
    assert (staging.tokens._arrays[0][2] == PAD_SLOT).sum() > 0 and (staging.tokens._arrays[1][2] == PAD_SLOT).sum() > 0


@pytest.mark.parametrize("copy", [True, False])
def test_a_fill_rewrites_the_staged_input_ids_before_the_model_reads_them(copy: bool) -> None:
    step = _three_decodes()
    previous = torch.tensor([70, 71, 72])

    def fill(ids: torch.Tensor) -> None:
        ids[1] = previous[2]

    staged = _staging(copy).stage_inputs(step, pad_to=4, fill=fill)
    assert staged.input_ids.tolist() == [step.input_ids[0], 72, step.input_ids[2], 0]
