"""Pipeline parallelism over gloo on CPU: the layers split into stages (vLLM's partition rule or an
explicit one), each stage holds only its own weights and KV cache, activations go stage to stage, the
last stage samples; with P stages the engine keeps P batches in flight. PP=2 (and PP=2 x TP=2) equal
PP=1 and transformers token for token, with chunked prefill, preemption, the prefix cache, aborts in
flight, seeded sampling, structured outputs and logprobs; a failing or killed stage fails the engine
promptly and leaves nothing behind.

One PP=2 LLM serves most scenarios (spawning workers and importing torch costs seconds): a 3-layer llama
split 2 + 1, a 16-token budget that chunks every prefill, a 32-block KV cache of 4-token blocks that forces
preemption.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine_svc.config import ConfigError, EngineConfig
from engine_svc.core import EngineCore
from engine_svc.distributed import parallel_state
from engine_svc.distributed.pipeline import partition_layers, stage_layer_range
from engine_svc.executor.multiproc import MultiprocExecutor, WorkerDiedError
from engine_svc.executor.worker_proc import FAULT_ENV
from engine_svc.model.layers.cpu_gemm import PREPACK_ENV
from engine_svc.worker.worker import Worker
from entrypoints import LLM, SamplingParams
from shared_runtime.contract import FinishReason, StructuredOutputs
from tests.engine.test_async_scheduling import core_requests, step_all, summary
from tests.engine.test_hf_exact import MAX_TOKENS, assert_no_block_leaks, hf_greedy, make_prompts
from tests.engine.test_multiproc import assert_cleaned_up

pytestmark = pytest.mark.timeout(240)
ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=32
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def token_ids(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def logprobs_of(outs: list) -> list[list[float]]:
    return [[e.logprob for e in o.outputs[0].logprobs or ()] for o in outs]


def prompt_logprobs_of(outs: list) -> list[list[float | None]]:
    return [[None if e is None else e.logprob for e in o.prompt_logprobs] for o in outs]


@pytest.fixture(scope="module")
def llama3(make_model):
    return make_model("llama", num_layers=3)


@pytest.fixture(scope="module")
def pp2(llama3) -> Iterator[LLM]:
    """A PP=2 LLM of the 3-layer llama: stage 0 holds layers 0-1 and the embedding, stage 1 layer 2,
    the norm and the head."""
    llm = LLM(str(llama3), pipeline_parallel_size=2, **ENGINE_ARGS)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def pp1(llama3) -> Iterator[LLM]:
    llm = LLM(str(llama3), **ENGINE_ARGS)
    yield llm
    llm.engine.shutdown()


class MaxInFlight:
    """Records the most batches an engine core had submitted and not yet taken back at once."""

    def __init__(self, core: EngineCore) -> None:
        self.most = 0
        executor = core.executor
        inner = executor.execute_model

        def execute_model(so: Any, non_block: bool = False) -> Any:
            self.most = max(self.most, core.num_batches_in_flight + 1)  # the queue, and this one
            return inner(so, non_block)  # type: ignore[call-overload]

        executor.execute_model = execute_model  # type: ignore[method-assign]


# ---- the partition and the configuration -----------------------------------------------------------------
def test_layer_partition_follows_vllms_rule_and_the_override() -> None:
    assert partition_layers(32, 4) == [8, 8, 8, 8]
    assert partition_layers(3, 2) == [2, 1]  # the remainder goes to the stages before the last
    assert partition_layers(10, 4) == [2, 3, 3, 2]
    assert partition_layers(7, 3) == [2, 3, 2]
    assert partition_layers(5, 1) == [5]
    assert partition_layers(3, 2, "1,2") == [1, 2]
    assert [stage_layer_range(10, s, 4) for s in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    for override, match in (("1,1", "sum to the model's 3"), ("3,0", "at least one layer"),
                            ("1,1,1", "has 3 entries"), ("a,b", "comma-separated integers")):
        with pytest.raises(ValueError, match=match):
            partition_layers(3, 2, override)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        partition_layers(2, 3)


def test_config_checks_the_pipeline_against_the_model(make_model) -> None:
    model = str(make_model("llama"))  # 2 layers
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 3 exceeds the model's 2 layers"):
        EngineConfig.create(model=model, device="cpu", pipeline_parallel_size=3)
    with pytest.raises(ConfigError, match="--pp-layer-partition '2,1' must give"):
        EngineConfig.create(model=model, device="cpu", pipeline_parallel_size=2, pp_layer_partition="2,1")
    with pytest.raises(ConfigError, match="--async-scheduling cannot be combined"):
        EngineConfig.create(model=model, device="cpu", pipeline_parallel_size=2, async_scheduling=True)
    with pytest.raises(ConfigError, match="--pp-layer-partition needs"):
        EngineConfig.create(model=model, device="cpu", pp_layer_partition="2")
    with pytest.raises(ConfigError, match="--pipeline-parallel-size must be >= 1"):
        EngineConfig.create(model=model, device="cpu", pipeline_parallel_size=0)
    config = EngineConfig.create(model=model, device="cpu", pipeline_parallel_size=2)
    assert not config.resolved_async_scheduling


@pytest.fixture
def as_stage(monkeypatch: pytest.MonkeyPatch):
    """Make this process believe it is pipeline stage `stage` of `stages` (for building stage models)."""

    def enter(stage: int, stages: int, partition: str | None = None) -> None:
        monkeypatch.setattr(parallel_state, "_PP_RANK", stage)
        monkeypatch.setattr(parallel_state, "_PP_SIZE", stages)
        monkeypatch.setattr(parallel_state, "_PARTITION", partition)

    return enter


@pytest.mark.parametrize(("tied", "partition"), [(False, None), (True, "1,2")])
def test_each_stage_holds_only_its_layers_weights_and_kv_cache(make_model, as_stage, monkeypatch, tied: bool,
                                                                partition: str | None) -> None:
    """Stage parameters are exactly the full model's, split by layer: the embedding on the first stage,
    the norm and head on the last (which also loads the embedding when the head is tied to it); the KV
    block of a stage covers its layers only."""
    monkeypatch.setenv(PREPACK_ENV, "0")  # keep the weights comparable (prepacking empties them)
    model_dir = make_model("qwen2", num_layers=3, tie_word_embeddings=tied)
    config = EngineConfig.create(model=str(model_dir), device="cpu", dtype="float32", block_size=4)
    full = Worker(config)
    full.load_model()
    assert full.model is not None
    whole = dict(full.model.named_parameters())
    counts = partition_layers(3, 2, partition)
    seen: set[str] = set()
    for stage in range(2):
        as_stage(stage, 2, partition)
        worker = Worker(config)
        worker.load_model()
        assert worker.model is not None
        params = dict(worker.model.named_parameters())
        start, end = stage_layer_range(3, stage, 2, partition)
        layers = {int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}
        assert layers == set(range(start, end))
        assert ("model.embed_tokens.weight" in params) == (stage == 0 or tied)
        assert ("model.norm.weight" in params) == (stage == 1)
        assert ("lm_head.weight" in params) == (stage == 1 and not tied)  # tied: the embedding's parameter
        for name, p in params.items():
            assert p.numel() and p.equal(whole[name]), name
        seen |= set(params)
        assert worker.kv_block_bytes * 3 == full.kv_block_bytes * counts[stage]
        if stage == 1 and tied:
            assert worker.model.is_tied
    assert seen == set(whole)


# ---- exactness ---------------------------------------------------------------------------------------------
def test_pp2_equals_pp1_and_transformers_with_chunking_preemption_and_logprobs(llama3, pp2, pp1) -> None:
    prompts = make_prompts(3, 5, 500, lo=20, hi=30)
    preemptions_before = pp2.engine.get_stats().num_preemptions
    spy = MaxInFlight(pp2.engine)
    got = pp2.generate(prompts, GREEDY, use_tqdm=False)
    assert pp2.engine.get_stats().num_preemptions > preemptions_before
    assert spy.most == pp2.engine.max_concurrent_batches == 2, "the pipeline never had both stages busy"
    assert_no_block_leaks(pp2)
    ref = pp1.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(got) == token_ids(ref)
    for g, prompt in zip(got, prompts, strict=True):
        assert g.outputs[0].token_ids == hf_greedy(llama3, prompt, MAX_TOKENS)[0]
    for a, b in zip(logprobs_of(got), logprobs_of(ref), strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    for a, b in zip(prompt_logprobs_of(got), prompt_logprobs_of(ref), strict=True):
        assert a[0] is None and b[0] is None and a[1:] == pytest.approx(b[1:], abs=1e-4)


def test_pp2_prefix_cache_hits_match_transformers(llama3, pp2) -> None:
    shared = make_prompts(4, 1, 500, lo=33, hi=33)[0]
    prompts = [shared + tail for tail in make_prompts(5, 3, 500, lo=2, hi=9)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = pp2.generate(prompts[:1], params, use_tqdm=False)
    rest = pp2.generate(prompts[1:], params, use_tqdm=False)
    assert all(out.num_cached_tokens >= 32 for out in rest)  # the 8 full shared blocks
    for prompt, out in zip(prompts, first + rest, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(llama3, prompt, MAX_TOKENS)[0]
    assert_no_block_leaks(pp2)


def test_pp2_seeded_sampling_and_structured_outputs_equal_pp1(pp2, pp1) -> None:
    prompts = make_prompts(7, 4, 500, lo=10, hi=30)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=10, logprobs=2)
              for i in range(len(prompts))]
    pattern = r"(ab|cd|[0-9]){4,20}"
    structured = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputs(regex=pattern))
    for params in (seeded, structured):
        got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (pp2, pp1))
        assert token_ids(got) == token_ids(want)
        for a, b in zip(logprobs_of(got), logprobs_of(want), strict=True):
            assert a == pytest.approx(b, abs=1e-4)
    for out in got:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert_no_block_leaks(pp2)


def test_eos_and_aborts_with_batches_in_flight_end_once_and_free_every_block(pp2, pp1) -> None:
    """Aborts and EOS while the request's next batch may be in a stage: each request ends exactly once,
    with the tokens an undisturbed run gave up to its end, and every block comes back."""
    prompts = make_prompts(13, 4, 500, lo=12, hi=20)  # prefills over several 16-token steps: cohorts form

    def run(llm: LLM, eos: int | None = None, abort_after: dict[str, int] | None = None) -> dict[str, Any]:
        for req in core_requests(prompts, temperature=0.0, max_tokens=10, ignore_eos=eos is None):
            req.eos_token_ids = [eos] if eos is not None and req.request_id == "r0" else []
            llm.engine.add_request(req)
        return summary(step_all(llm.engine, abort_after))

    greedy = run(pp1)
    eos = greedy["r0"][0][4]
    spy = MaxInFlight(pp2.engine)
    got = run(pp2, eos, abort_after={"r1": 3, "r2": 1})  # first on pp2: a cold prefix cache
    assert spy.most == 2
    r0_tokens, r0_finish = got["r0"]
    assert r0_tokens == greedy["r0"][0][: r0_tokens.index(eos) + 1] and r0_finish == FinishReason.STOP
    assert got["r1"] == (greedy["r1"][0][:3], FinishReason.ABORT)
    assert got["r2"] == (greedy["r2"][0][:1], FinishReason.ABORT)
    assert got["r3"] == greedy["r3"]
    assert run(pp2) == greedy
    assert_no_block_leaks(pp2)


@pytest.mark.slow
def test_pp2_tp2_equals_pp1(make_model, pp1) -> None:
    """Four workers: two stages of two TP ranks (each stage's TP group its own, the hand-off TP rank
    to TP rank)."""
    prompts = make_prompts(3, 5, 500, lo=20, hi=30)
    llm = LLM(str(make_model("llama", num_layers=3)), pipeline_parallel_size=2, tensor_parallel_size=2,
              **ENGINE_ARGS)
    try:
        assert len(llm.engine.executor.worker_pids) == 4  # type: ignore[attr-defined]
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_no_block_leaks(llm)
    finally:
        llm.engine.shutdown()
    ref = pp1.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(got) == token_ids(ref)
    for a, b in zip(logprobs_of(got), logprobs_of(ref), strict=True):
        assert a == pytest.approx(b, abs=1e-4)


# ---- faults ----------------------------------------------------------------------------------------------
def worker_state(llm: LLM) -> tuple[list[int], list[str]]:
    ex = llm.engine.executor
    assert isinstance(ex, MultiprocExecutor)
    return ex.worker_pids, [f"/dev/shm/{name}" for name in ex.shm_names]


def test_an_exception_in_the_last_stage_fails_generate_and_cleans_up(make_model, monkeypatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "rank=1,step=4")
    llm = LLM(str(make_model("llama")), pipeline_parallel_size=2, device="cpu", dtype="float32")
    pids, segments = worker_state(llm)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"(?s)rank 1 .*InjectedFault.*step 4"):
        llm.generate(make_prompts(8, 3, 500), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 15
    assert_cleaned_up(pids, segments)


@pytest.mark.parametrize("stage", [0, 1])
def test_sigkill_of_a_stage_fails_generate_and_cleans_up(make_model, stage: int) -> None:
    """Killing either stage (the first: the last is left waiting for activations; the last: the one
    that answers) fails the next step within seconds."""
    llm = LLM(str(make_model("llama")), pipeline_parallel_size=2, device="cpu", dtype="float32")
    pids, segments = worker_state(llm)
    llm.generate(make_prompts(9, 2, 500), GREEDY, use_tqdm=False)  # healthy first
    os.kill(pids[stage], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"rank {stage} .*code -9"):
        llm.generate(make_prompts(10, 2, 500), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert_cleaned_up(pids, segments)


def test_the_kv_cache_is_sized_per_stage_and_the_engine_takes_the_smallest(make_model) -> None:
    """Stages split 2 + 1 layers: with the same memory the 2-layer stage fits half the blocks the other
    does, and every stage gets that count."""
    model_dir = make_model("llama", num_layers=3)
    one_layer_block = Worker(EngineConfig.create(model=str(model_dir), device="cpu", dtype="float32",
                                                 block_size=4))
    one_layer_block.load_model()
    per_layer = one_layer_block.kv_block_bytes // 3
    budget = 100 * per_layer
    config = EngineConfig.create(model=str(model_dir), device="cpu", dtype="float32", block_size=4,
                                 pipeline_parallel_size=2, kv_cache_memory_bytes=budget)
    ex = MultiprocExecutor(config)
    try:
        assert ex.initialize() == 50  # stage 0: 2 layers (stage 1 alone would fit 100)
        assert ex.kv_block_bytes == per_layer  # the answering (last) stage's block: its one layer
    finally:
        ex.shutdown()
