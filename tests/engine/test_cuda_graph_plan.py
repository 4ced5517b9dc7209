"""The CPU-checkable parts of decode CUDA graphs (engine_svc/worker/cuda_graphs.py).

Pure planning is driven with plain data: the capture-size list, padding to the next size, decode-only
detection and the eager fallbacks, when graphs are switched off. The padding (in place, in the runner's
`StepStaging`, tests/engine/test_staging.py) is then checked end to end on CPU with the triton backend
(interpreter): a `DecodeCudaGraphs` whose
"replay" runs the would-be-captured forward eagerly must give the same tokens as the plain eager runner,
and its dummy rows must never write the KV cache. Only the capture/replay calls themselves need a GPU
(tests/gpu/test_cuda_graphs.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_svc.config import EngineConfig
from engine_svc.worker.cuda_graphs import (
    DecodeCudaGraphs,
    capture_sizes,
    graph_batch_size,
    graphs_off_reason,
    maybe_capture_decode_graphs,
    padded_batch_size,
)
from engine_svc.worker.input_batch import InputBatch, StepInputs
from engine_svc.worker.staging import StepStaging

SIZES_256 = capture_sizes(256)


# ---- capture sizes -----------------------------------------------------------------------------
def test_capture_sizes_default_max_num_seqs() -> None:
    assert [1, 2, 4, *range(8, 257, 8)] == SIZES_256
    assert len(SIZES_256) == 35


def test_capture_sizes_step_16_beyond_256() -> None:
    sizes = capture_sizes(512)
    assert sizes[:35] == SIZES_256
    assert sizes[35:] == list(range(272, 513, 16))


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
     (300, [*SIZES_256, 272, 288, 300])],
)
def test_capture_sizes_capped_at_max_num_seqs(max_num_seqs: int, expected: list[int]) -> None:
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_rejects_empty() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


# ---- padding to the next size / eager fallback -------------------------------------------------
@pytest.mark.parametrize(
    ("num_reqs", "expected"),
    [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 24), (255, 256), (256, 256), (257, None)],
)
def test_padded_batch_size(num_reqs: int, expected: int | None) -> None:
    assert padded_batch_size(num_reqs, SIZES_256) == expected


def test_padded_batch_size_uneven_cap() -> None:
    sizes = capture_sizes(100)
    assert padded_batch_size(97, sizes) == 100
    assert padded_batch_size(96, sizes) == 96
    assert padded_batch_size(101, sizes) is None


@pytest.mark.parametrize(
    ("num_reqs", "num_decodes", "expected"),
    [
        (3, 3, 4),  # decode-only: padded up
        (16, 16, 16),  # decode-only, exact size
        (3, 2, None),  # a prefill chunk in the batch
        (1, 0, None),  # a lone prefill
        (0, 0, None),  # nothing scheduled
        (9, 9, None),  # more requests than the largest captured size
    ],
)
def test_graph_batch_size(num_reqs: int, num_decodes: int, expected: int | None) -> None:
    sizes = [1, 2, 4, 8, 16] if num_reqs != 9 else [1, 2, 4, 8]
    assert graph_batch_size(num_reqs, num_decodes, sizes) == expected


def _batch_with(reqs: dict[str, tuple[int, int]], block_size: int = 4) -> InputBatch:
    """An InputBatch holding requests name -> (num tokens known, num computed), blocks 10, 11, ..."""
    batch = InputBatch(max_num_reqs=8, max_model_len=64, block_size=block_size)
    next_block = 10
    for name, (num_tokens, num_computed) in reqs.items():
        nb = -(-num_tokens // block_size)
        tokens = [100 + 7 * len(batch.row_of) + i for i in range(num_tokens)]
        batch.add(name, tokens, list(range(next_block, next_block + nb)), num_computed)
        next_block += nb
    return batch


def test_plan_from_real_step_inputs() -> None:
    batch = _batch_with({"a": (6, 5), "b": (9, 8), "c": (3, 0)})
    decode_step = batch.prepare({"a": 1, "b": 1})
    mixed_step = batch.prepare({"a": 1, "b": 1, "c": 3})
    assert graph_batch_size(len(decode_step.req_ids), decode_step.num_decodes, SIZES_256) == 2
    assert graph_batch_size(len(mixed_step.req_ids), mixed_step.num_decodes, SIZES_256) is None


def test_q_len_one_prefill_counts_as_decode() -> None:
    # "c" has 3 prompt tokens, 2 already cached (prefix hit): its last token runs with q_len == 1.
    batch = _batch_with({"a": (6, 5), "c": (3, 2)})
    step = batch.prepare({"a": 1, "c": 1})
    assert graph_batch_size(len(step.req_ids), step.num_decodes, SIZES_256) == 2


# ---- when graphs are off -----------------------------------------------------------------------
def test_graphs_off_reasons() -> None:
    def reason(**kw: object) -> str | None:
        args = dict(device_type="cuda", attention_backend="triton", enforce_eager=False, tensor_parallel_size=1)
        args.update(kw)
        return graphs_off_reason(**args)  # type: ignore[arg-type]

    assert reason() is None
    assert "CUDA" in (reason(device_type="cpu") or "")
    assert "enforce-eager" in (reason(enforce_eager=True) or "")
    assert "torch attention backend" in (reason(attention_backend="torch") or "")
    assert "tensor parallelism" in (reason(tensor_parallel_size=2) or "")


def test_no_capture_on_cpu() -> None:
    config = EngineConfig(model="unused", device="cpu", attention_backend="triton")
    staging = StepStaging(torch.device("cpu"), max_tokens=8, max_reqs=8, max_blocks_per_req=4)
    got = maybe_capture_decode_graphs(config, torch.nn.Identity(), [], device=torch.device("cpu"), staging=staging)
    assert got is None


# ---- end to end on CPU: everything except the capture itself -----------------------------------
class EagerReplayGraphs(DecodeCudaGraphs):
    """Runs the would-be-captured forward eagerly instead of replaying a CUDA graph."""

    def _run(self, size: int) -> torch.Tensor:
        return self.forward_static(size)


def _stub_graphs(llm, sizes: list[int]) -> EagerReplayGraphs:
    worker = llm.engine.executor.worker
    runner = worker.runner
    return EagerReplayGraphs(worker.model, runner.kv_caches, sizes=sizes, staging=runner.staging,
                             block_size=llm.config.block_size, device=worker.device)


def _count_decode_only_steps(runner) -> list[int]:
    """Wrap the runner's batch.prepare to count steps in which every request has q_len == 1."""
    count = [0]
    inner = runner.batch.prepare

    def prepare(num_scheduled: dict[str, int]) -> StepInputs:
        inputs = inner(num_scheduled)
        count[0] += inputs.num_decodes == len(inputs.req_ids)
        return inputs

    runner.batch.prepare = prepare
    return count


@pytest.fixture(scope="module")
def triton_llm(make_model):
    from entrypoints import LLM

    # On a GPU machine the same test runs on CUDA (the interpreter is off there); enforce_eager keeps the
    # engine's own capture out of the way so the stub below is the only graph path.
    on_gpu = torch.cuda.is_available()
    return LLM(str(make_model("llama")), dtype="float32", attention_backend="triton", max_model_len=64,
               max_num_seqs=8, device="cuda" if on_gpu else "cpu", enforce_eager=on_gpu)


def test_padded_replay_path_matches_eager(triton_llm) -> None:
    from entrypoints import SamplingParams

    rng = random.Random(3)
    # Lengths over 16 give full blocks, so the second run hits the prefix cache (q_len == 1 steps).
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (5, 19, 33, 7, 18)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 4, 6, 2, 5)]
    runner = triton_llm.engine.executor.worker.runner
    assert runner.cuda_graphs is None  # never captured: CPU, or enforce_eager on CUDA

    eager = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params, use_tqdm=False)]
    runner.cuda_graphs = graphs = _stub_graphs(triton_llm, sizes=[1, 2, 4, 8])
    decode_only_steps = _count_decode_only_steps(runner)
    try:
        replayed = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params, use_tqdm=False)]
    finally:
        runner.cuda_graphs = None
        del runner.batch.prepare
    assert replayed == eager
    assert graphs.num_replays == decode_only_steps[0] > 0


def test_dummy_rows_never_write_the_cache(triton_llm) -> None:
    worker = triton_llm.engine.executor.worker
    runner = worker.runner
    block_size = triton_llm.config.block_size
    caches = [torch.zeros_like(c[:, :4]) for c in runner.kv_caches]  # a fresh 4-block cache
    staging = StepStaging(worker.device, max_tokens=8, max_reqs=4, max_blocks_per_req=4)
    graphs = EagerReplayGraphs(worker.model, caches, sizes=[4], staging=staging, block_size=block_size,
                               device=worker.device)
    batch = InputBatch(max_num_reqs=4, max_model_len=4 * block_size, block_size=block_size)
    batch.add("only", list(range(20, 26)), [2], num_computed=5)  # its 6th token lands in slot 2*bs + 5
    step = batch.prepare({"only": 1})

    hidden = graphs.replay(step, 4)
    assert hidden.shape == (1, worker.model.config.hidden_size)
    for cache in caches:
        written_slots = cache.abs().sum(dim=(0, 3, 4)).flatten().nonzero().flatten().tolist()
        assert written_slots == [2 * block_size + 5]
