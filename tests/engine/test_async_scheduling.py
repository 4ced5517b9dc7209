"""Async scheduling end to end: the engine with `--async-scheduling` against the same engine without it.

Synchronous scheduling is the oracle (it equals transformers token for token: test_hf_exact.py), and the
greedy scenarios check transformers directly too. Each scenario runs the same prompts through two offline
`LLM`s and requires the same tokens, logprobs, finish reasons and text, for greedy and seeded sampling,
through finishes (EOS, stop ids, max_tokens), aborts (stop strings, matched by the frontend after the
next step was already scheduled), preemption, chunked prefill, prefix caching over generated tokens,
structured outputs, prompt logprobs, n > 1 and TP = 2 over gloo; and every KV block back afterwards.

`StepSpy` proves the overlap happened: the async engine scheduled steps on output placeholders (step N+1
planned before step N's tokens were known), and it wasted no step on a request that max_tokens ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.executor.multiproc import MultiprocExecutor
from engine_svc.sched.output import PLACEHOLDER_TOKEN, SchedulerOutput
from engine_svc.worker.worker import Worker
from entrypoints import LLM, SamplingParams
from shared_runtime.contract import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineSamplingParams,
    FinishReason,
    StructuredOutputs,
)
from tests.engine.test_hf_exact import MAX_TOKENS, assert_no_block_leaks, hf_greedy, make_prompts

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
PREEMPT_ARGS = dict(num_gpu_blocks_override=12, block_size=4, max_num_batched_tokens=64)


class StepSpy:
    """Records every SchedulerOutput an engine core schedules."""

    def __init__(self, core: EngineCore) -> None:
        self.outputs: list[SchedulerOutput] = []
        inner = core.scheduler.schedule

        def schedule() -> SchedulerOutput:
            so = inner()
            self.outputs.append(so)
            return so

        core.scheduler.schedule = schedule  # type: ignore[method-assign]

    @property
    def placeholder_steps(self) -> int:
        """Steps that ran a token the scheduler had not seen yet."""
        return sum(PLACEHOLDER_TOKEN in so.decode_token_ids
                   or any(PLACEHOLDER_TOKEN in d.new_token_ids for d in so.scheduled_cached_reqs)
                   for so in self.outputs)

    @property
    def scheduled_tokens(self) -> int:
        return sum(so.total_num_scheduled_tokens for so in self.outputs)


def make_llm(model_dir: Any, async_scheduling: bool, **engine_args: Any) -> tuple[LLM, StepSpy]:
    llm = LLM(str(model_dir), dtype="float32", async_scheduling=async_scheduling, **engine_args)
    return llm, StepSpy(llm.engine)


def comparable(outs: list) -> list:
    """Per completion: tokens, finish reason, text, logprobs (value, rank, top ids), prompt logprobs."""
    rows = []
    for out in outs:
        prompt_lps = [None if e is None else (e.logprob, e.rank) for e in (out.prompt_logprobs or [])]
        for c in out.outputs:
            lps = [(e.logprob, e.rank, e.top) for e in (c.logprobs or [])]
            rows.append((out.num_cached_tokens, c.token_ids, c.finish_reason, c.text, lps, prompt_lps))
    return rows


def run_pair(model_dir: Any, prompts: list, params: Any, **engine_args: Any) -> tuple[list, list, StepSpy, StepSpy]:
    """(sync outputs, async outputs, sync spy, async spy); both engines end with every block back."""
    results = []
    for async_scheduling in (False, True):
        llm, spy = make_llm(model_dir, async_scheduling, **engine_args)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert_no_block_leaks(llm)
            assert llm.engine.num_batches_in_flight == 0
        finally:
            llm.engine.shutdown()
        results.append((outs, spy))
    (sync_outs, sync_spy), (async_outs, async_spy) = results
    assert sync_spy.placeholder_steps == 0
    assert async_spy.placeholder_steps > 0, "async scheduling never scheduled ahead of a sampled token"
    assert comparable(async_outs) == comparable(sync_outs)
    return sync_outs, async_outs, sync_spy, async_spy


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_sync_and_transformers_and_wastes_no_step_on_max_tokens(make_model, arch: str) -> None:
    model_dir = make_model(arch)
    prompts = make_prompts(1, 6, 500)
    _, outs, sync_spy, async_spy = run_pair(model_dir, prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
    assert async_spy.scheduled_tokens == sync_spy.scheduled_tokens  # every request ends by max_tokens


def test_chunked_prefill_and_the_long_prefill_cap(make_model) -> None:
    model_dir = make_model("llama")
    prompts = make_prompts(7, 5, 500, lo=20, hi=40)
    _, outs, _, _ = run_pair(model_dir, prompts, GREEDY, max_num_batched_tokens=16, block_size=8,
                             long_prefill_token_threshold=5)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]


def test_preemption_with_samples_in_flight(make_model, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_svc.sched.scheduler import Scheduler

    in_flight: list[int] = []
    inner = Scheduler._preempt

    def preempt(self: Scheduler, request: Any) -> None:
        in_flight.append(request.num_output_placeholders)
        inner(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    model_dir = make_model("llama")
    prompts = make_prompts(3, 5, 500, lo=5, hi=8)
    _, outs, _, _ = run_pair(model_dir, prompts, GREEDY, **PREEMPT_ARGS)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
    assert any(in_flight), "no request was preempted while its sampled token was in flight"


SAMPLED = [
    SamplingParams(temperature=0.8, seed=7, max_tokens=15, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=10, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.2),
    SamplingParams(temperature=1.0, seed=3, max_tokens=12, min_tokens=5, stop_token_ids=list(range(7, 500, 9))),
    SamplingParams(temperature=0.7, seed=11, n=3, max_tokens=9),
    SamplingParams(temperature=0.9, seed=5, max_tokens=14, top_k=20, top_p=0.9, bad_words=["the"]),
    SamplingParams(temperature=0.6, seed=2, max_tokens=11, min_p=0.05, prompt_logprobs=1),
]


@pytest.mark.parametrize("engine_args", [{}, PREEMPT_ARGS | {"num_gpu_blocks_override": 24}],
                         ids=["roomy", "preempting"])
def test_seeded_sampling_penalties_stops_logprobs_and_n(make_model, engine_args: dict) -> None:
    prompts = make_prompts(11, len(SAMPLED), 500, lo=5, hi=9)
    sync_outs, _, sync_spy, async_spy = run_pair(make_model("llama"), prompts, SAMPLED, **engine_args)
    stopped = sum(c.finish_reason == "stop" for out in sync_outs for c in out.outputs)
    assert stopped > 0  # the stop ids do end a request early
    if not engine_args:  # (preemption recomputes a different amount in each mode)
        assert 0 <= async_spy.scheduled_tokens - sync_spy.scheduled_tokens <= stopped


def test_stop_strings_aborted_by_the_frontend_after_the_next_step_was_scheduled(make_model) -> None:
    model_dir = make_model("llama")
    prompts = make_prompts(5, 6, 500, lo=4, hi=10)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, stop=["e", "a"]) for i, t in
              enumerate([0.0, 0.8, 0.0, 1.0, 0.5, 0.0])]
    _, async_outs, _, _ = run_pair(model_dir, prompts, params)
    assert sum(out.outputs[0].finish_reason == "stop" for out in async_outs) >= 3
    for out in async_outs:
        assert "e" not in out.outputs[0].text and "a" not in out.outputs[0].text


def test_prefix_cache_hits_on_blocks_filled_by_placeholders(make_model) -> None:
    """A follow-up whose prompt is an earlier prompt plus its completion hits the blocks that decoding
    filled, some of them through placeholder tokens (cached once their token was known)."""
    model_dir = make_model("llama")
    first = make_prompts(4, 2, 500, lo=5, hi=5)
    params = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    cached: dict[bool, list[int]] = {}
    tokens: dict[bool, list] = {}
    for async_scheduling in (False, True):
        llm, _ = make_llm(model_dir, async_scheduling, block_size=4)
        try:
            outs = llm.generate(first, params, use_tqdm=False)
            follow = [p + o.outputs[0].token_ids + [7] for p, o in zip(first, outs)]
            again = llm.generate(follow, params, use_tqdm=False)
            cached[async_scheduling] = [o.num_cached_tokens for o in again]
            tokens[async_scheduling] = [o.outputs[0].token_ids for o in outs + again]
            assert_no_block_leaks(llm)
        finally:
            llm.engine.shutdown()
    assert tokens[True] == tokens[False]
    assert cached[True] == cached[False] == [16, 16]  # 20 known tokens: blocks 0-3 (the last block recomputes)


def test_structured_outputs_do_not_overlap_and_equal_sync(make_model) -> None:
    import re

    number = r"[1-9][0-9]{0,3}-[a-c]{2}"
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured_outputs=StructuredOutputs(regex=number),
                       n=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),  # unconstrained: overlaps
        SamplingParams(temperature=0.8, seed=4, max_tokens=20,
                       structured_outputs=StructuredOutputs(choice=["yes", "no", "maybe so"])),
    ]
    prompts = make_prompts(9, 3, 500, lo=4, hi=8)
    _, async_outs, _, async_spy = run_pair(make_model("llama"), prompts, params, block_size=8)
    for out in (async_outs[0], async_outs[2]):
        for c in out.outputs:
            assert c.error is None
            assert re.fullmatch(number, c.text) or c.text in ("yes", "no", "maybe so"), c.text
    constrained_steps = 0
    for so in async_spy.outputs:  # a constrained row never runs on a placeholder: its mask needs that token
        ph = {r for r, t in zip(so.decode_req_ids, so.decode_token_ids) if t == PLACEHOLDER_TOKEN}
        ph |= {d.req_id for d in so.scheduled_cached_reqs if PLACEHOLDER_TOKEN in d.new_token_ids}
        masked = set(so.grammar.req_ids) if so.grammar else set()
        constrained_steps += bool(masked)
        assert not ph & masked, "a bitmask row on a placeholder"
    assert constrained_steps > 5


# ---- the engine core directly: aborts, EOS, id reuse ---------------------------------------------------
def core_requests(prompts: list[list[int]], **params: Any) -> list[EngineCoreRequest]:
    return [EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=p, sampling_params=EngineSamplingParams(**params))
            for i, p in enumerate(prompts)]


def step_all(core: EngineCore, abort_after: dict[str, int] | None = None) -> dict[str, list[EngineCoreOutputs]]:
    """Step until done; abort request r right after the step that brought its abort_after[r]-th token."""
    seen: dict[str, list] = {}
    counts: dict[str, int] = {}
    generated = 0  # the per-step stats' count (what metrics add up): each step counted once
    while core.has_unfinished_requests():
        outputs = core.step()
        assert outputs.scheduler_stats is not None
        generated += outputs.scheduler_stats.num_generation_tokens
        for out in outputs.outputs:
            seen.setdefault(out.request_id, []).append(out)
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if abort_after and counts[out.request_id] == abort_after.get(out.request_id) and not out.finish_reason:
                core.abort_requests([out.request_id])
    assert generated == sum(counts.values())
    assert core.num_batches_in_flight == 0  # stepping until nothing is unfinished drains the queue
    return seen


def summary(seen: dict[str, list]) -> dict[str, tuple[list[int], int]]:
    """Per request: its tokens and its finish reason (which must come exactly once, last)."""
    result = {}
    for rid, outs in seen.items():
        assert [bool(o.finish_reason) for o in outs] == [False] * (len(outs) - 1) + [True], rid
        result[rid] = ([t for o in outs for t in o.new_token_ids], int(outs[-1].finish_reason))
    return result


def make_core(model_dir: Any, async_scheduling: bool, **kw: Any) -> EngineCore:
    return EngineCore(EngineConfig.create(model=str(model_dir), dtype="float32", device="cpu",
                                          async_scheduling=async_scheduling, **kw))


def test_eos_and_aborts_in_flight_emit_nothing_past_the_end_and_free_every_block(make_model) -> None:
    model_dir = make_model("llama")
    prompts = make_prompts(13, 4, 500, lo=4, hi=9)
    reference = make_core(model_dir, False)
    for req in core_requests(prompts, temperature=0.0, max_tokens=10, ignore_eos=True):
        reference.add_request(req)
    greedy = summary(step_all(reference))
    reference.shutdown()
    eos = greedy["r0"][0][4]  # r0's 5th token becomes its EOS: it stops there
    results, scheduled = {}, {}
    for async_scheduling in (False, True):
        core = make_core(model_dir, async_scheduling)
        spy = StepSpy(core)
        for req in core_requests(prompts, temperature=0.0, max_tokens=10):
            req.eos_token_ids = [eos] if req.request_id == "r0" else []
            core.add_request(req)
        results[async_scheduling] = summary(step_all(core, abort_after={"r1": 3, "r2": 1}))
        scheduled[async_scheduling] = {r: sum(so.num_scheduled_tokens.get(r, 0) for so in spy.outputs)
                                       for r in ("r0", "r1", "r2", "r3")}
        assert core.get_stats().num_free_blocks == core.num_blocks and not core.has_unfinished_requests()
        core.shutdown()
    assert results[True] == results[False]
    r0_tokens, r0_finish = results[True]["r0"]
    assert r0_tokens[-1] == eos and r0_finish == FinishReason.STOP and len(r0_tokens) <= 5
    assert results[True]["r1"] == (greedy["r1"][0][:3], FinishReason.ABORT)
    assert results[True]["r2"] == (greedy["r2"][0][:1], FinishReason.ABORT)
    waste = {r: scheduled[True][r] - scheduled[False][r] for r in scheduled[True]}
    assert waste == {"r0": 1, "r1": 1, "r2": 1, "r3": 0}  # one step past an end nobody could foresee


def test_each_step_is_counted_once_in_the_stats_across_idle_gaps(make_model) -> None:
    """A step that only fills the queue updates nothing: its stats carry no token counts (metrics add
    them up per step), also when it follows an earlier run's last update."""
    core = make_core(make_model("llama"), True)
    for prompts in (make_prompts(37, 2, 500, lo=4, hi=6), make_prompts(41, 1, 500, lo=4, hi=6)):
        for req in core_requests(prompts, temperature=0.0, max_tokens=5, ignore_eos=True):
            core.add_request(req)
        step_all(core)  # checks the sum of the stats' counts against the tokens
    core.shutdown()


def test_a_request_id_reused_right_after_it_ended_gets_only_its_own_tokens(make_model) -> None:
    model_dir = make_model("llama")
    a, b = make_prompts(17, 2, 500, lo=5, hi=8)
    greedy = dict(temperature=0.0, ignore_eos=True)
    expected = {}
    core = make_core(model_dir, False)
    for name, prompt in (("a", a), ("b", b)):
        core.add_request(EngineCoreRequest(request_id="x", prompt_token_ids=prompt,
                                           sampling_params=EngineSamplingParams(max_tokens=6, **greedy)))
        expected[name] = summary(step_all(core))["x"][0]
    core.shutdown()
    core = make_core(model_dir, True)
    core.add_request(EngineCoreRequest(request_id="x", prompt_token_ids=a,
                                       sampling_params=EngineSamplingParams(max_tokens=20, **greedy)))
    seen: list = []
    while sum(len(o.new_token_ids) for o in seen) < 3:
        seen += core.step().outputs
    core.abort_requests(["x"])  # its next step is already in flight ...
    assert core.num_batches_in_flight == 1
    core.add_request(EngineCoreRequest(request_id="x", prompt_token_ids=b,  # ... when its id comes again
                                       sampling_params=EngineSamplingParams(max_tokens=6, **greedy)))
    after = [o for outs in step_all(core).values() for o in outs]
    assert after[0].finish_reason == FinishReason.ABORT and not after[0].new_token_ids  # the first x ends
    assert [t for o in seen for t in o.new_token_ids] == expected["a"][:3]
    assert summary({"x": after[1:]})["x"] == (expected["b"], FinishReason.LENGTH)
    assert core.get_stats().num_free_blocks == core.num_blocks
    core.shutdown()


# ---- the batch queue -----------------------------------------------------------------------------------
def test_a_deeper_queue_with_synchronous_scheduling_equals_depth_one(make_model) -> None:
    """The queue is general: three batches in flight (as pipeline stages would keep), each taking the
    requests that have something to compute, give the tokens of one at a time."""
    model_dir = make_model("llama")
    prompts = make_prompts(19, 6, 500, lo=5, hi=30)
    params = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = make_core(model_dir, False, max_num_batched_tokens=16)
    for req in core_requests(prompts, **params):
        reference.add_request(req)
    expected = summary(step_all(reference))
    reference.shutdown()
    core = make_core(model_dir, True, max_num_batched_tokens=16)  # (a worker thread to run steps on)
    core.scheduler.async_scheduling = False
    core.max_concurrent_batches = 3
    assert core.scheduler.steps_in_flight  # the scheduler tracks samples in flight at depth > 1
    depths: list[int] = []
    submit = core.executor.submit

    def counted(so: SchedulerOutput) -> Any:
        depths.append(core.num_batches_in_flight + 1)
        return submit(so)

    core.executor.submit = counted  # type: ignore[method-assign]
    for req in core_requests(prompts, **params):
        core.add_request(req)
    assert summary(step_all(core)) == expected
    assert max(depths) == 3 and core.get_stats().num_free_blocks == core.num_blocks
    core.shutdown()


def test_the_busy_loop_drives_the_queue(make_model) -> None:
    import threading

    from engine_svc.busy_loop import BusyLoop

    model_dir = make_model("llama")
    prompts = make_prompts(23, 5, 500, lo=4, hi=12)
    reference = make_core(model_dir, False)
    for req in core_requests(prompts, temperature=0.0, max_tokens=9, ignore_eos=True):
        reference.add_request(req)
    expected = summary(step_all(reference))
    reference.shutdown()
    delivered: dict[str, list] = {}
    done = threading.Event()

    def deliver(stream_id: int, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            delivered.setdefault(out.request_id, []).append(out)
        if sum(bool(o[-1].finish_reason) for o in delivered.values()) == len(prompts):
            done.set()

    ready = threading.Event()
    loop = BusyLoop(lambda: make_core(model_dir, True), deliver, on_ready=lambda core: ready.set())
    loop.start()
    assert ready.wait(60)
    for req in core_requests(prompts, temperature=0.0, max_tokens=9, ignore_eos=True):
        loop.add(1, req)
    assert done.wait(60)
    loop.stop()
    loop.join(30)
    assert summary(delivered) == expected
    assert loop.core is not None and loop.core.get_stats().num_free_blocks == loop.core.num_blocks
    loop.core.shutdown()


# ---- tensor parallelism ----------------------------------------------------------------------------------
class SkewedSamplerWorker(Worker):
    """A real worker whose rank 1 samples token 0 whatever the logits say: under async scheduling every
    rank must still feed rank 0's sampled ids into the next step (as the scheduler's diffs do without it)."""

    def load_model(self) -> None:
        super().load_model()
        if self.rank == 1:
            assert self.runner is not None
            sampler = self.runner.sampler

            class Zero:
                def __call__(self, logits: Any, meta: Any) -> Any:
                    out = sampler(logits, meta)
                    out.sampled_token_ids.zero_()
                    return out

            self.runner.sampler = Zero()  # type: ignore[assignment]


@pytest.fixture(scope="module")
def tp_prompts() -> list[list[int]]:
    return make_prompts(29, 4, 500, lo=18, hi=26)


TP_ARGS = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=32)


@pytest.fixture(scope="module")
def tp1_reference(make_model, tp_prompts) -> Iterator[list]:
    llm = LLM(str(make_model("llama")), **TP_ARGS)
    outs = llm.generate(tp_prompts, [GREEDY, SAMPLED[0], SAMPLED[3], GREEDY], use_tqdm=False)
    llm.engine.shutdown()
    yield outs


def test_tp2_async_equals_tp1_sync_with_chunking_and_preemption(make_model, tp_prompts, tp1_reference) -> None:
    llm = LLM(str(make_model("llama")), tensor_parallel_size=2, async_scheduling=True, **TP_ARGS)
    spy = StepSpy(llm.engine)
    try:
        outs = llm.generate(tp_prompts, [GREEDY, SAMPLED[0], SAMPLED[3], GREEDY], use_tqdm=False)
        assert llm.engine.get_stats().num_preemptions > 0 and spy.placeholder_steps > 0
        assert_no_block_leaks(llm)
    finally:
        llm.engine.shutdown()
    assert [c.token_ids for o in outs for c in o.outputs] == [c.token_ids for o in tp1_reference for c in o.outputs]
    for got, ref in zip(outs, tp1_reference, strict=True):  # (TP sums partial products in another order)
        for g, r in zip(got.outputs, ref.outputs, strict=True):
            assert [e.logprob for e in g.logprobs or []] == pytest.approx([e.logprob for e in r.logprobs or []],
                                                                          abs=1e-4)


def test_tp2_ranks_feed_rank0s_sampled_ids(make_model, tp_prompts, tp1_reference) -> None:
    config = EngineConfig.create(model=str(make_model("llama")), tensor_parallel_size=2, async_scheduling=True,
                                 **TP_ARGS)
    core = EngineCore(config, MultiprocExecutor(config, worker_cls=f"{__name__}:SkewedSamplerWorker"))
    try:
        for req in core_requests(tp_prompts, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True):
            core.add_request(req)
        got = summary(step_all(core))
    finally:
        core.shutdown()
    expected = [out.outputs[0].token_ids for out in tp1_reference]
    assert got["r0"][0] == expected[0] and got["r3"][0] == expected[3]


def test_an_async_llm_dropped_without_shutdown_is_freed_with_its_worker_thread(make_model) -> None:
    """The worker thread of async scheduling must not keep a dropped engine (its model and KV cache) alive:
    after `del` and a collection the executor is gone and its thread has ended."""
    import gc
    import threading
    import weakref

    before = set(threading.enumerate())
    llm = LLM(str(make_model("llama")), async_scheduling=True, num_gpu_blocks_override=16, block_size=4)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))  # the worker thread has run
    executor = weakref.ref(llm.engine.executor)
    workers = [t for t in threading.enumerate() if t not in before and t.name.startswith("tandem-worker")]
    assert workers
    del llm
    gc.collect()
    assert executor() is None
    for thread in workers:
        thread.join(timeout=10)
        assert not thread.is_alive()
