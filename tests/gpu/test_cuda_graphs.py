"""Decode CUDA graphs on a real GPU: replaying captured graphs gives the same greedy tokens as eager.

float32 and max_model_len 128 keep both paths on the same kernels (the attention kernel picks one KV
split for contexts that short, with or without the graphs' max_seq_len bound), so tokens must match
exactly. Five prompts with different output lengths make the decode batch shrink 5 -> 1 over captured
sizes 1, 2, 4, 8: padded replays (5 -> 8, 3 -> 4) and exact ones alike.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

OUTPUT_LENS = (24, 9, 17, 3, 24)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (5, 23, 40, 11, 17)]


def _generate(model_dir, prompts: list[list[int]], enforce_eager: bool):
    from entrypoints import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", device="cuda", attention_backend="triton",
              max_model_len=128, max_num_seqs=8, enforce_eager=enforce_eager)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in OUTPUT_LENS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.engine.executor.worker.runner
    return [o.outputs[0].token_ids for o in outs], runner.cuda_graphs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_replay_matches_eager(make_model, arch: str) -> None:
    model_dir = make_model(arch)
    prompts = _prompts(500)
    eager_tokens, no_graphs = _generate(model_dir, prompts, enforce_eager=True)
    graph_tokens, graphs = _generate(model_dir, prompts, enforce_eager=False)

    assert no_graphs is None
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    assert graphs.num_replays == max(OUTPUT_LENS) - 1  # one prefill step, then every step replays
    assert 0 < graphs.memory_bytes < 1 << 30  # measured net of the allocator cache (was negative)
    assert [len(t) for t in graph_tokens] == list(OUTPUT_LENS)
    assert graph_tokens == eager_tokens


def test_short_rotary_cache_with_a_large_token_budget(make_model) -> None:
    """The issue-11 crash: max_position_embeddings 256 < max_num_batched_tokens 8192 made the profile
    run gather past the rotary cache (a device-side assert); the engine must start and generate."""
    from entrypoints import LLM, SamplingParams

    llm = LLM(str(make_model("qwen3", max_position_embeddings=256)), dtype="bfloat16", device="cuda",
              attention_backend="triton", max_num_batched_tokens=8192, max_num_seqs=8)
    assert llm.config.max_model_len == 256
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_torch_backend_on_cuda_runs_without_graphs(make_model) -> None:
    from entrypoints import LLM, SamplingParams

    llm = LLM(str(make_model("llama")), dtype="float32", device="cuda", attention_backend="torch",
              max_model_len=128, max_num_seqs=8)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert llm.engine.executor.worker.runner.cuda_graphs is None
    assert len(out[0].outputs[0].token_ids) == 4
