"""Tensor parallelism over gloo on CPU: TP=2 equals TP=1 and transformers token for token, weights really
shard, and a failing or killed worker fails the engine promptly without leaving processes or /dev/shm
segments behind.

One TP=2 LLM per architecture serves every scenario (spawning workers and importing torch costs seconds):
a 16-token budget chunks every prefill, a 32-block KV cache of 4-token blocks forces preemption, and a
repeated 32-token prefix hits the prefix cache. llama has GQA (2 KV heads: one per rank), qwen2 has MQA
(1 KV head, replicated on both ranks) with qkv bias, qwen3 has q/k norms and an explicit head_dim.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_svc.config import EngineConfig
from engine_svc.executor.multiproc import MultiprocExecutor, WorkerDiedError
from engine_svc.executor.worker_proc import FAULT_ENV
from engine_svc.worker.worker import Worker
from entrypoints import LLM, SamplingParams
from shared_runtime.contract import StructuredOutputs
from tests.engine.test_hf_exact import MAX_TOKENS, assert_no_block_leaks, hf_greedy, make_prompts
from tests.engine.test_multiproc import assert_cleaned_up

pytestmark = pytest.mark.timeout(180)
TP_ARCHS = ("llama", "qwen2", "qwen3")
ENGINE_ARGS = dict(
    device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=32
)
DUMP_ENV = "TANDEM_TEST_SHARD_DUMP"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


class ShardDumpingWorker(Worker):
    """A real Worker that also saves its loaded parameters to $TANDEM_TEST_SHARD_DUMP/rank{r}.pt."""

    def load_model(self) -> None:
        super().load_model()
        assert self.model is not None
        state = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        torch.save(state, Path(os.environ[DUMP_ENV]) / f"rank{self.rank}.pt")


@pytest.fixture(scope="module")
def tp_llms(make_model) -> Iterator[dict[str, LLM]]:
    """arch -> a TP=2 LLM, created on first use; every one is shut down at the end of the module."""
    made: dict[str, LLM] = {}

    class Lazy(dict):
        def __missing__(self, arch: str) -> LLM:
            made[arch] = self[arch] = LLM(str(make_model(arch)), tensor_parallel_size=2, **ENGINE_ARGS)
            return made[arch]

    yield Lazy()
    for llm in made.values():
        llm.engine.shutdown()


def worker_state(llm: LLM) -> tuple[list[int], list[str]]:
    ex = llm.engine.executor
    assert isinstance(ex, MultiprocExecutor)
    return ex.worker_pids, [f"/dev/shm/{name}" for name in ex.shm_names]


def token_ids(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tp2_equals_tp1_and_transformers_with_chunking_and_preemption(make_model, tp_llms, arch: str) -> None:
    model_dir = make_model(arch)
    prompts = make_prompts(3, 5, 500, lo=20, hi=30)
    tp2 = tp_llms[arch]
    preemptions_before = tp2.engine.get_stats().num_preemptions
    got = tp2.generate(prompts, GREEDY, use_tqdm=False)
    assert tp2.engine.get_stats().num_preemptions > preemptions_before
    assert_no_block_leaks(tp2)

    tp1 = LLM(str(model_dir), **ENGINE_ARGS)
    ref = tp1.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(got) == token_ids(ref)
    for g, r, prompt in zip(got, ref, prompts, strict=True):
        assert g.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
        got_lp = [e.logprob for e in g.outputs[0].logprobs]
        assert got_lp == pytest.approx([e.logprob for e in r.outputs[0].logprobs], abs=1e-4)


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tp2_prefix_cache_hits_match_transformers(make_model, tp_llms, arch: str) -> None:
    model_dir = make_model(arch)
    shared = make_prompts(4, 1, 500, lo=33, hi=33)[0]
    prompts = [shared + tail for tail in make_prompts(5, 3, 500, lo=2, hi=9)]
    llm = tp_llms[arch]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(out.num_cached_tokens >= 32 for out in rest)  # the 8 full shared blocks
    for prompt, out in zip(prompts, first + rest, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
    assert_no_block_leaks(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_really_shard(make_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """Each rank holds its slice of every parallel layer (KV heads replicated under MQA); stitched
    together the slices are exactly the TP=1 parameters. kv_block_bytes is per rank."""
    model_dir = make_model(arch)
    monkeypatch.setenv(DUMP_ENV, str(tmp_path))
    config = EngineConfig.create(
        model=str(model_dir), tensor_parallel_size=2, device="cpu", dtype="float32", num_gpu_blocks_override=8
    )
    ex = MultiprocExecutor(config, worker_cls="tests.engine.test_tp:ShardDumpingWorker")
    try:
        ex.initialize()
        tp2_block_bytes = ex.kv_block_bytes
    finally:
        ex.shutdown()
    full_worker = Worker(EngineConfig.create(model=str(model_dir), device="cpu", dtype="float32"))
    full_worker.load_model()
    assert full_worker.model is not None
    full = dict(full_worker.model.named_parameters())
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert set(shards[0]) == set(shards[1]) == set(full)
    num_kv = {"llama": 2, "qwen2": 1}[arch]
    for name, param in full.items():
        parts = [s[name] for s in shards]
        if "qkv_proj" in name:
            check_qkv(param, parts, num_heads=4, num_kv_heads=num_kv)
        elif "gate_up_proj" in name:
            half = param.shape[0] // 2
            assert torch.equal(torch.cat([p[: half // 2] for p in parts]), param[:half]), name
            assert torch.equal(torch.cat([p[half // 2 :] for p in parts]), param[half:]), name
        elif parts[0].shape == param.shape:
            assert all(torch.equal(p, param) for p in parts), f"{name} should be replicated"
        else:
            dim = next(d for d in range(param.dim()) if parts[0].shape[d] != param.shape[d])
            assert parts[0].shape[dim] * 2 == param.shape[dim], name
            assert torch.equal(torch.cat(parts, dim=dim), param), name
    # llama: one of 2 KV heads per rank -> half the KV bytes; qwen2: its single KV head on both ranks.
    assert tp2_block_bytes * (2 if num_kv == 2 else 1) == full_worker.kv_block_bytes


def check_qkv(full: torch.Tensor, parts: list[torch.Tensor], num_heads: int, num_kv_heads: int) -> None:
    head_dim = full.shape[0] // (num_heads + 2 * num_kv_heads)
    q, k, v = full.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    q_rank = num_heads // 2 * head_dim
    kv_rank = max(1, num_kv_heads // 2) * head_dim
    splits = [p.split([q_rank, kv_rank, kv_rank]) for p in parts]
    assert torch.equal(torch.cat([s[0] for s in splits]), q)
    for i, whole in ((1, k), (2, v)):
        if num_kv_heads >= 2:
            assert torch.equal(torch.cat([s[i] for s in splits]), whole)
        else:  # fewer KV heads than ranks: each rank holds the whole (replicated) head
            assert all(torch.equal(s[i], whole) for s in splits)


def test_exception_in_a_ranks_forward_fails_generate_and_cleans_up(make_model, monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=4")
    llm = LLM(str(make_model("llama")), tensor_parallel_size=2, device="cpu", dtype="float32")
    pids, segments = worker_state(llm)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"(?s)rank 1 .*InjectedFault.*step 4"):
        llm.generate(make_prompts(8, 3, 500), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 15
    assert_cleaned_up(pids, segments)


def test_sigkill_of_a_worker_fails_generate_and_cleans_up(tp_llms) -> None:
    llm = tp_llms["qwen3"]
    del tp_llms["qwen3"]  # this one dies here: a test after this one gets a fresh TP=2 qwen3
    pids, segments = worker_state(llm)
    llm.generate(make_prompts(9, 2, 500), GREEDY, use_tqdm=False)  # healthy first
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 .*code -9"):
        llm.generate(make_prompts(10, 2, 500), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert_cleaned_up(pids, segments)
    with pytest.raises(WorkerDiedError):
        llm.engine.executor.check_health()


def test_tp2_structured_outputs_equal_tp1(make_model, tp_llms) -> None:
    """The grammar bitmask is computed once on the driver and travels with the step: every rank masks the
    same rows, so constrained greedy outputs (with chunked prefill and preemption) equal TP=1's."""
    pattern = r"(ab|cd|[0-9]){4,20}"
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputs(regex=pattern))
    prompts = make_prompts(11, 4, 500, lo=20, hi=30)
    tp1 = LLM(str(make_model("llama")), **ENGINE_ARGS)
    want = token_ids(tp1.generate(prompts, params, use_tqdm=False))
    got = tp_llms["llama"].generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == want
    for out in got:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert_no_block_leaks(tp_llms["llama"])
