"""MoE models over two gloo ranks on CPU: tensor parallelism (every expert's intermediate dim sharded) and
expert parallelism (`enable_expert_parallel`: whole experts per rank) each equal TP=1 and transformers
token for token, through chunked prefill, preemption and prefix-cache hits (test_tp.py's scenario), and
each rank holds exactly its part of the experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_svc.attention.torch_backend import TorchAttentionBackend
from engine_svc.config import EngineConfig
from engine_svc.executor.multiproc import MultiprocExecutor
from engine_svc.model.loader import load_model
from entrypoints import LLM
from tests.engine.test_hf_exact import MAX_TOKENS, assert_no_block_leaks, hf_greedy, make_prompts
from tests.engine.test_tp import DUMP_ENV, ENGINE_ARGS, GREEDY, token_ids

pytestmark = pytest.mark.timeout(300)
LAYOUTS = [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", False), ("mixtral", True), ("gpt_oss", False),
           ("gpt_oss", True)]


@pytest.fixture(scope="module")
def parallel_llms(make_model) -> Iterator[dict[tuple[str, bool], LLM]]:
    """(arch, expert_parallel) -> a 2-rank LLM, created on first use, shut down at the end."""
    made: dict[tuple[str, bool], LLM] = {}

    class Lazy(dict):
        def __missing__(self, key: tuple[str, bool]) -> LLM:
            arch, ep = key
            made[key] = self[key] = LLM(str(make_model(arch)), tensor_parallel_size=2, enable_expert_parallel=ep,
                                        **ENGINE_ARGS)
            return made[key]

    yield Lazy()
    for llm in made.values():
        llm.engine.shutdown()


@pytest.mark.parametrize(("arch", "expert_parallel"), LAYOUTS)
def test_two_ranks_equal_one_and_transformers(make_model, parallel_llms, arch: str, expert_parallel: bool) -> None:
    model_dir = make_model(arch)
    prompts = make_prompts(3, 5, 500, lo=20, hi=30)
    llm = parallel_llms[(arch, expert_parallel)]
    preemptions_before = llm.engine.get_stats().num_preemptions
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > preemptions_before
    assert_no_block_leaks(llm)

    ref = LLM(str(model_dir), **ENGINE_ARGS).generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(got) == token_ids(ref)
    for g, r, prompt in zip(got, ref, prompts, strict=True):
        assert g.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
        got_lp = [e.logprob for e in g.outputs[0].logprobs]
        assert got_lp == pytest.approx([e.logprob for e in r.outputs[0].logprobs], abs=1e-4)


@pytest.mark.parametrize(("arch", "expert_parallel"), LAYOUTS[:2])
def test_two_ranks_prefix_cache_hits_match_transformers(make_model, parallel_llms, arch: str,
                                                        expert_parallel: bool) -> None:
    model_dir = make_model(arch)
    shared = make_prompts(4, 1, 500, lo=33, hi=33)[0]
    prompts = [shared + tail for tail in make_prompts(5, 3, 500, lo=2, hi=9)]
    llm = parallel_llms[(arch, expert_parallel)]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(out.num_cached_tokens >= 32 for out in rest)
    for prompt, out in zip(prompts, first + rest, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
    assert_no_block_leaks(llm)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_holds_its_part_of_the_experts(make_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 expert_parallel: bool) -> None:
    """EP: rank r holds experts [4r, 4r + 4) whole; TP: every expert, half of its intermediate dim."""
    model_dir = make_model("mixtral")
    monkeypatch.setenv(DUMP_ENV, str(tmp_path))
    monkeypatch.setenv("TANDEM_CPU_PREPACK", "0")  # keep the stacked weights to compare
    config = EngineConfig.create(model=str(model_dir), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                                 device="cpu", dtype="float32", num_gpu_blocks_override=8)
    ex = MultiprocExecutor(config, worker_cls="tests.engine.test_tp:ShardDumpingWorker")
    try:
        ex.initialize()
    finally:
        ex.shutdown()
    full = dict(load_model(model_dir, torch.float32, "cpu", TorchAttentionBackend()).named_parameters())
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for layer in range(2):
        w13 = f"model.layers.{layer}.mlp.experts.w13_weight"
        w2 = f"model.layers.{layer}.mlp.experts.w2_weight"
        if expert_parallel:
            for r in range(2):
                assert torch.equal(shards[r][w13], full[w13][4 * r : 4 * r + 4])
                assert torch.equal(shards[r][w2], full[w2][4 * r : 4 * r + 4])
        else:
            gate, up = full[w13].chunk(2, dim=1)
            for r in range(2):
                assert torch.equal(shards[r][w13], torch.cat([gate[:, 16 * r : 16 * r + 16],
                                                              up[:, 16 * r : 16 * r + 16]], dim=1))
                assert torch.equal(shards[r][w2], full[w2][:, :, 16 * r : 16 * r + 16])
        router = f"model.layers.{layer}.mlp.gate.weight"
        assert all(torch.equal(s[router], full[router]) for s in shards)
