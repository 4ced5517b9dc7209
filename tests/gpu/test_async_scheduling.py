"""Async scheduling on a real GPU: the same tokens as synchronous scheduling, with CUDA graphs and the triton
backend (the placeholder fill writes the graphs' input buffer on the device), greedy and seeded, through
finishes, preemption and n > 1, and every KV block back.

float32 and max_model_len 128 keep both modes on the same kernels, as tests/gpu/test_cuda_graphs.py does;
a step that async scheduling wastes on a request that just ended pads a replay differently, so logprobs
are compared within 1e-5 and tokens exactly.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_async_scheduling import StepSpy, comparable
from tests.engine.test_hf_exact import make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _params() -> list:
    from engine_svc import SamplingParams

    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.8, seed=7, top_p=0.9, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.4, repetition_penalty=1.1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=18, min_tokens=4, stop_token_ids=list(range(7, 500, 9))),
        SamplingParams(temperature=0.7, seed=11, n=2, max_tokens=12),
    ]


def _run(model_dir, async_scheduling: bool, **engine_args):
    from entrypoints import LLM

    llm = LLM(str(model_dir), dtype="float32", device="cuda", attention_backend="triton", max_model_len=128,
              max_num_seqs=8, async_scheduling=async_scheduling, **engine_args)
    spy = StepSpy(llm.engine)
    try:
        outs = llm.generate(make_prompts(31, 5, 500, lo=5, hi=40), _params(), use_tqdm=False)
        stats = llm.engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks and llm.engine.num_batches_in_flight == 0
        graphs = llm.engine.executor.worker.runner.cuda_graphs
        return outs, spy, graphs.num_replays if graphs is not None else 0, stats.num_preemptions
    finally:
        llm.engine.shutdown()


def _strip_logprobs(rows: list) -> tuple[list, list]:
    return [r[:4] + r[5:] for r in rows], [[lp[0] for lp in r[4]] for r in rows]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("engine_args", [{}, {"num_gpu_blocks_override": 20, "block_size": 4}],
                         ids=["roomy", "preempting"])
def test_async_equals_sync_on_cuda_with_graphs(make_model, arch: str, engine_args: dict) -> None:
    model_dir = make_model(arch)
    sync_outs, sync_spy, _, _ = _run(model_dir, False, **engine_args)
    async_outs, async_spy, replays, preemptions = _run(model_dir, True, **engine_args)
    assert sync_spy.placeholder_steps == 0 and async_spy.placeholder_steps > 10
    assert replays > 10  # decode steps replayed graphs whose input ids the fill wrote
    if engine_args:
        assert preemptions > 0
    sync_rows, sync_lps = _strip_logprobs(comparable(sync_outs))
    async_rows, async_lps = _strip_logprobs(comparable(async_outs))
    assert async_rows == sync_rows
    for got, want in zip(async_lps, sync_lps, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
