"""Speculative decoding together with async scheduling, against speculation off and async scheduling off.

The oracles: plain synchronous decoding (itself equal to transformers: test_hf_exact.py) for greedy
requests, and for seeded sampled ones too (a seeded request's tokens are plain decoding's whatever the
drafts: engine_svc/spec/rejection.py); synchronous speculation for the acceptance counters (prompt
lookup proposes from the same tokens on the worker as on the scheduler). The `looping` model (its
greedy output cycles, so prompt lookup predicts it) accepts most drafts; the random llama rejects most.
Layer 1's attention moves every logprob, so K/V written at a wrong position (a position not corrected
for the previous step's rejected drafts) shows in the tokens or the logprobs.

Every test also checks that the overlap is kept: steps of speculating requests are scheduled while the
previous step is in flight (a `StepSpy` on the scheduler counts them).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_svc.core import EngineCore
from engine_svc.sched.scheduler import Scheduler
from engine_svc.spec.proposers import PENDING_DRAFT
from engine_svc.worker.worker import Worker
from entrypoints import LLM, SamplingParams
from entrypoints.layer_draft import make_layer_draft
from shared_runtime.contract import FinishReason, StructuredOutputs
from tests.engine.test_async_scheduling import core_requests, make_core, step_all, summary
from tests.engine.test_hf_exact import assert_no_block_leaks
from tests.engine.test_spec_decode import (
    NGRAM,
    assert_same_logprobs,
    completions,
    looping_dir,  # noqa: F401 (a fixture)
    repetitive_prompts,
    served_tokens,
    stops_inside_runs,
)
from tests.engine.test_spec_draft_model import SMALL_STEPS  # drafts cross blocks; prompts in chunks
from tests.engine.test_spec_eagle3 import eagle_spec, heads  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)


class OverlapSpy:
    """Counts the schedules that gave draft places to a request with a verification in flight."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.overlapped = 0
        schedule = scheduler.schedule

        def spy() -> Any:
            in_flight = {r.request_id for r in scheduler.running if r.num_spec_in_flight}
            so = schedule()
            self.overlapped += len(in_flight & set(so.scheduled_spec_decode_tokens))
            return so

        scheduler.schedule = spy  # type: ignore[method-assign]


OPEN: list[LLM] = []  # the engines `run` built during the current test


@pytest.fixture(autouse=True)
def shut_down_engines() -> Iterator[None]:
    """Every engine `run` built during a test is shut down after it: an async-scheduling engine's step
    thread keeps it, and its KV cache (1 GiB by default on CPU), alive after the test drops it."""
    yield
    while OPEN:
        OPEN.pop().engine.shutdown()


def run(model_dir: Path, prompts: list[list[int]], params: Any, spec: dict[str, Any] | None, async_: bool,
        **engine_args: Any) -> tuple[list, LLM, OverlapSpy]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", speculative_config=spec, async_scheduling=async_,
              **engine_args)
    OPEN.append(llm)
    spy = OverlapSpy(llm.engine.scheduler)
    return llm.generate(prompts, params, use_tqdm=False), llm, spy


@pytest.fixture(scope="module")
def oracles() -> dict[str, Any]:
    """The module's plain-decoding references by their inputs (see `plain`)."""
    return {}


def plain(oracles: dict[str, Any], model_dir: Path, prompts: list[list[int]], params: Any,
          **engine_args: Any) -> list:
    """Plain synchronous decoding's outputs (speculation and async scheduling off): the oracle. Its greedy
    and seeded outputs are a function of the inputs, so tests with the same inputs share one run."""
    key = repr(("plain", str(model_dir), prompts, params, sorted(engine_args.items())))
    if key not in oracles:
        got, llm, _ = run(model_dir, prompts, params, None, False, **engine_args)
        llm.engine.shutdown()
        oracles[key] = got
    return oracles[key]


def plain_core(oracles: dict[str, Any], model_dir: Path, prompts: list[list[int]], **params: Any
               ) -> dict[str, tuple[list[int], int]]:
    """`plain` through an EngineCore stepped to the end (SMALL_STEPS): each request's tokens and finish."""
    key = repr(("core", str(model_dir), prompts, sorted(params.items())))
    if key not in oracles:
        reference = make_core(model_dir, False, **SMALL_STEPS)
        for req in core_requests(prompts, **params):
            reference.add_request(req)
        oracles[key] = summary(step_all(reference))
        reference.shutdown()
    return oracles[key]


@pytest.fixture(scope="module")
def draft_dir(looping_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return make_layer_draft(looping_dir, tmp_path_factory.mktemp("draft") / "near", 2, scale_attention=0.5)


def spec_of(method: str, draft_dir: Path, heads: dict[str, Path], k: int, head: str = "random"  # noqa: F811
            ) -> dict[str, Any]:
    """`head`: the EAGLE-3 head (`constant` proposes the looping model's most frequent token: accepted)."""
    if method == "ngram":
        return {**NGRAM, "num_speculative_tokens": k}
    if method == "draft_model":
        return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    return eagle_spec(heads[head], k)


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize(("method", "model"), [("ngram", "random"), ("ngram", "looping"),
                                               ("draft_model", "looping"), ("eagle3", "looping")])
def test_greedy_async_speculation_equals_plain_sync_decoding(method: str, model: str, llama_dir: Path,
                                                             looping_dir: Path, draft_dir: Path,  # noqa: F811
                                                             heads: dict[str, Path],  # noqa: F811
                                                             oracles: dict[str, Any]) -> None:
    """Chunked prefill, prefix caching (the prompts share prefixes), blocks that drafts cross. The random
    llama and the random EAGLE-3 head reject most drafts (the correction path), the others accept most."""
    model_dir = llama_dir if model == "random" else looping_dir
    prompts = repetitive_prompts(5, 5)
    prompts += [prompts[0] + [7, 8, 9]]  # a prefix-cache hit on the first prompt's blocks
    plain_out = plain(oracles, model_dir, prompts, GREEDY, **SMALL_STEPS)
    spec = spec_of(method, draft_dir, heads, 3)
    got, llm, spy = run(model_dir, prompts, GREEDY, spec, True, **SMALL_STEPS)
    assert completions(got) == completions(plain_out)
    assert_same_logprobs(plain_out, got)
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0 and spy.overlapped > 0
    if model == "looping" and method != "eagle3":
        assert stats.spec_decode_num_accepted_tokens > 0.5 * stats.spec_decode_num_draft_tokens
    assert_no_block_leaks(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_stops_and_max_tokens_inside_accepted_runs(method: str, looping_dir: Path, draft_dir: Path,  # noqa: F811
                                                   heads: dict[str, Path],  # noqa: F811
                                                   oracles: dict[str, Any]) -> None:
    """A stop id deep in the cycle, a stop string and max_tokens 23 end each request where plain
    synchronous decoding ends it, with drafts being accepted around them."""
    if "stops_inside_runs" not in oracles:  # its own reference run: once per module
        oracles["stops_inside_runs"] = stops_inside_runs(looping_dir)
    prompts, params, cycle_token, stop_string = oracles["stops_inside_runs"]
    plain_out = plain(oracles, looping_dir, prompts, params)
    got, llm, spy = run(looping_dir, prompts, params, spec_of(method, draft_dir, heads, 4, "constant"), True)
    assert completions(got) == completions(plain_out)
    assert plain_out[0].outputs[0].stop_reason == cycle_token and len(plain_out[2].outputs[0].token_ids) == 23
    assert plain_out[1].outputs[0].stop_reason == stop_string
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and spy.overlapped > 0
    assert_no_block_leaks(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_gives_the_tokens_of_plain_and_sync_speculative_decoding(
        method: str, looping_dir: Path, draft_dir: Path, heads: dict[str, Path],  # noqa: F811
        oracles: dict[str, Any]) -> None:
    """Seeded requests beside unseeded and penalised ones: their tokens are plain decoding's and
    synchronous speculation's."""
    prompts = repetitive_prompts(2, 4)
    seeded = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=24, ignore_eos=True, top_k=20, logprobs=1)
              for i in range(2)]
    others = [SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.2)]
    plain_out = plain(oracles, looping_dir, prompts[:2], seeded)
    batch = [prompts[2], prompts[0], prompts[3], prompts[1]]
    params = [others[0], seeded[0], others[1], seeded[1]]
    spec = spec_of(method, draft_dir, heads, 3)
    sync_spec, _, _ = run(looping_dir, batch, params, spec, False, **SMALL_STEPS)
    got, llm, spy = run(looping_dir, batch, params, spec, True, **SMALL_STEPS)
    assert completions([got[1], got[3]]) == completions([sync_spec[1], sync_spec[3]]) == completions(plain_out)
    assert_same_logprobs(plain_out, [got[1], got[3]])
    assert completions([got[2]]) == completions([sync_spec[2]])  # greedy with a penalty
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0 and spy.overlapped > 0
    assert_no_block_leaks(llm)


def step_with_aborts(core: EngineCore, abort_at: dict[str, int]) -> dict[str, list]:
    """Step until done; abort request r once it has at least abort_at[r] tokens (runs bring several)."""
    seen: dict[str, list] = {}
    counts: dict[str, int] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            seen.setdefault(out.request_id, []).append(out)
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if counts[out.request_id] >= abort_at.get(out.request_id, 1 << 30) and not out.finish_reason:
                core.abort_requests([out.request_id])
    return seen


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_eos_aborts_and_preemptions_with_verifications_in_flight_free_every_block(
        method: str, looping_dir: Path, draft_dir: Path, heads: dict[str, Path],  # noqa: F811
        oracles: dict[str, Any]) -> None:
    """16 blocks of 4 tokens for 6 requests: verifying requests are preempted with a verification in
    flight; an EOS inside an accepted run, aborts right after a run; the others' tokens are plain
    decoding's, and every block is back at the end."""
    prompts = repetitive_prompts(9, 6)
    greedy = plain_core(oracles, looping_dir, prompts, temperature=0.0, max_tokens=30, ignore_eos=True)
    eos = greedy["r0"][0][12]  # deep in r0's cycle
    core = make_core(looping_dir, True, speculative_config=spec_of(method, draft_dir, heads, 3),
                     num_gpu_blocks_override=16, **SMALL_STEPS)
    spy = OverlapSpy(core.scheduler)
    for req in core_requests(prompts, temperature=0.0, max_tokens=30):
        req.eos_token_ids = [eos] if req.request_id == "r0" else []
        core.add_request(req)
    got = summary(step_with_aborts(core, {"r1": 5, "r2": 1}))
    stats = core.get_stats()
    assert stats.num_free_blocks == core.num_blocks and not core.has_unfinished_requests()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_drafts > 0 and spy.overlapped > 0
    core.shutdown()
    r0 = greedy["r0"][0]
    assert got["r0"] == (r0[: r0.index(eos) + 1], FinishReason.STOP)
    for r in ("r1", "r2"):
        tokens, finish = got[r]
        assert finish == FinishReason.ABORT and tokens == greedy[r][0][: len(tokens)]
    assert {r: got[r] for r in ("r3", "r4", "r5")} == {r: greedy[r] for r in ("r3", "r4", "r5")}


def test_async_scheduling_with_speculation_is_accepted_and_the_scheduler_reserves_places(llama_dir: Path) -> None:
    """The combination once refused is a valid configuration; under it the scheduler proposes nothing
    itself (no proposer): drafts come from the workers, into PENDING_DRAFT places."""
    from engine_svc.config import EngineConfig

    cfg = EngineConfig.create(model=str(llama_dir), async_scheduling=True,
                              speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert cfg.resolved_async_scheduling and cfg.speculative is not None
    core = EngineCore(cfg)
    try:
        assert core.scheduler._proposer is None
        core.add_request(core_requests([[5, 6, 7, 5, 6]], temperature=0.0, max_tokens=6, ignore_eos=True)[0])
        first = core.scheduler.schedule()  # the prefill
        assert not first.scheduled_spec_decode_tokens
        core.scheduler.steps_in_flight = True
        second = core.scheduler.schedule()  # the prefill's token in flight: 1 + 2 places over it
        assert second.num_scheduled_tokens == {"r0": 3}
        assert second.scheduled_spec_decode_tokens == {"r0": [PENDING_DRAFT, PENDING_DRAFT]}
        request = core.scheduler.requests["r0"]
        assert (request.num_output_placeholders, request.num_spec_in_flight) == (4, 2)
    finally:
        core.shutdown()


@pytest.mark.slow  # two worker processes over gloo
def test_tp2_async_prompt_lookup_equals_plain_tp1(looping_dir: Path) -> None:  # noqa: F811
    """Each rank expands rank 0's runs and proposes from them: greedy tokens and logprobs are plain
    decoding's; sampled requests beside them run too (their runs broadcast)."""
    prompts = repetitive_prompts(8, 4)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    params = [greedy] * 3 + [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)]
    plain, _, _ = run(looping_dir, prompts[:3], greedy, None, False, **SMALL_STEPS)
    got, llm, spy = run(looping_dir, prompts, params, NGRAM, True, tensor_parallel_size=2, **SMALL_STEPS)
    try:
        assert completions(got[:3]) == completions(plain)
        assert_same_logprobs(plain, got[:3])
        assert len(got[3].outputs[0].token_ids) == 24
        assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0 and spy.overlapped > 0
        assert_no_block_leaks(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow  # a `tandem serve` process
def test_tandem_serve_with_async_scheduling_and_prompt_lookup(looping_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    prompt = repetitive_prompts(12, 1)[0]
    plain, _, _ = run(looping_dir, [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), None,
                      False)
    served = served_tokens(looping_dir, NGRAM, prompt, 16, tmp_path, ("--async-scheduling",))
    assert served == plain[0].outputs[0].token_ids


def test_constrained_requests_beside_speculating_ones(looping_dir: Path) -> None:  # noqa: F811
    """A constrained request (regex, seeded) and a speculating one in the same steps: the constrained one
    gets no draft places (its bitmask rows would need the drafts) and its tokens are plain sync
    decoding's; the other's too, with drafts accepted."""
    number = r"[1-9][0-9]{0,3}-[a-c]{2}"
    prompts = repetitive_prompts(6, 2)
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured_outputs=StructuredOutputs(regex=number)),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    plain, _, _ = run(looping_dir, prompts, params, None, False)
    got, llm, spy = run(looping_dir, prompts, params, NGRAM, True)
    assert completions(got) == completions(plain)
    assert re.fullmatch(number, got[0].outputs[0].text)
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0 and spy.overlapped > 0
    assert_no_block_leaks(llm)


class SkewedVerifierWorker(Worker):
    """A real worker whose rank 1 ends every verified run with token 0 whatever its logits say: each rank
    expands its runs into its own next step under async scheduling, so every rank must take rank 0's."""

    def load_model(self) -> None:
        super().load_model()
        if self.rank == 1:
            import engine_svc.worker.spec_step as spec_step

            verify = spec_step.verify

            def skewed(*args: Any, **kwargs: Any) -> list[list[int]]:
                return [[*run[:-1], 0] for run in verify(*args, **kwargs)]

            spec_step.verify = skewed


@pytest.mark.slow  # two worker processes over gloo
def test_tp2_ranks_expand_rank0s_runs(looping_dir: Path) -> None:  # noqa: F811
    from engine_svc.config import EngineConfig
    from engine_svc.executor.multiproc import MultiprocExecutor

    prompts = repetitive_prompts(8, 3)
    reference = make_core(looping_dir, False, **SMALL_STEPS)
    for req in core_requests(prompts, temperature=0.0, max_tokens=24, ignore_eos=True):
        reference.add_request(req)
    expected = summary(step_all(reference))
    reference.shutdown()
    config = EngineConfig.create(model=str(looping_dir), dtype="float32", device="cpu", tensor_parallel_size=2,
                                 async_scheduling=True, speculative_config=NGRAM, **SMALL_STEPS)
    core = EngineCore(config, MultiprocExecutor(config, worker_cls=f"{__name__}:SkewedVerifierWorker"))
    try:
        for req in core_requests(prompts, temperature=0.0, max_tokens=24, ignore_eos=True):
            core.add_request(req)
        got = summary(step_all(core))
        assert core.get_stats().spec_decode_num_accepted_tokens > 0
    finally:
        core.shutdown()
    assert got == expected
