"""V1 scheduler driven by fake model outputs: exact budgets, block ids, victims and stop reasons.

Every scheduler made through the `make_sched` fixture is checked on teardown: once all requests are
finished, every block is free again.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from engine_svc.request import Request, RequestStatus
from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput
from engine_svc.sched.scheduler import Scheduler
from shared_runtime.contract import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineSamplingParams,
    ErrorCode,
    EventType,
    FinishReason,
)

MakeSched = Callable[..., Scheduler]
EMPTY_RUN = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
_arrivals = itertools.count(1)


@pytest.fixture
def make_sched() -> Iterator[MakeSched]:
    made: list[Scheduler] = []

    def make(**overrides: Any) -> Scheduler:
        kwargs: dict[str, Any] = dict(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=8
        )
        kwargs.update(overrides)
        sched = Scheduler(**kwargs)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.finish_requests(list(sched.requests))
        sched.update_from_output(sched.schedule(), EMPTY_RUN)
        assert sched.kv.num_free_blocks == sched.kv.num_blocks, "KV blocks leaked"
        assert not sched.has_unfinished_requests()


def add(
    sched: Scheduler,
    rid: str,
    prompt: list[int],
    *,
    priority: int = 0,
    arrival: float | None = None,
    eos: tuple[int, ...] = (),
    **params: Any,
) -> Request:
    core_req = EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=EngineSamplingParams(**params),
        eos_token_ids=list(eos),
        arrival_time=float(next(_arrivals)) if arrival is None else arrival,
        priority=priority,
    )
    request = Request(core_req, sched.max_model_len)
    sched.add_request(request)
    return request


def run_model(
    sched: Scheduler, so: SchedulerOutput, tokens: dict[str, int] | None = None, default: int = 7
) -> ModelRunnerOutput:
    """A fake model: a request samples (tokens.get(id, default)) when its step reaches its last token;
    prompt logprobs (when asked) come for the prompt positions this step's tokens predict."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    prompt_logprobs: dict[str, list[tuple[int, float, int, list[int], list[float]]]] = {}
    for rid, n in so.num_scheduled_tokens.items():
        r = sched.requests[rid]
        sampled.append((tokens or {}).get(rid, default) if r.num_computed_tokens == r.num_tokens else -1)
        if r.sampling_params.prompt_logprobs is not None:
            start = r.num_computed_tokens - n
            positions = range(start + 1, min(start + n, r.num_prompt_tokens - 1) + 1)
            prompt_logprobs[rid] = [(r.prompt_token_ids[p], -float(p), 1, [], []) for p in positions]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, prompt_logprobs=prompt_logprobs)


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    so = sched.schedule()
    return so, sched.update_from_output(so, run_model(sched, so, tokens))


def by_id(out: EngineCoreOutputs) -> dict[str, EngineCoreOutput]:
    ids = [o.request_id for o in out.outputs]
    assert len(ids) == len(set(ids)), "one output per request per step"
    return {o.request_id: o for o in out.outputs}


def event_types(o: EngineCoreOutput) -> list[EventType]:
    return [e.type for e in o.events]


# ---- the basic loop --------------------------------------------------------------------------------------
def test_new_request_sent_once_then_diffs(make_sched: MakeSched) -> None:
    sched = make_sched()
    add(sched, "a", [1, 2, 3, 4, 5, 6], max_tokens=10)
    so, out = step(sched, {"a": 7})
    (new,) = so.scheduled_new_reqs
    assert (new.req_id, new.token_ids, new.block_ids, new.num_computed_tokens) == (
        "a",
        [1, 2, 3, 4, 5, 6],
        [0, 1],
        0,
    )
    assert so.scheduled_cached_reqs == [] and so.num_scheduled_tokens == {"a": 6}
    o = by_id(out)["a"]
    assert o.new_token_ids == [7] and not o.finished
    assert event_types(o) == [EventType.QUEUED, EventType.SCHEDULED, EventType.FIRST_TOKEN]

    diffs = []
    for tok in (8, 9, 10):
        so, out = step(sched, {"a": tok})
        assert so.scheduled_new_reqs == [] and so.num_scheduled_tokens == {"a": 1}
        (d,) = so.cached_diffs()
        diffs.append((d.new_token_ids, d.new_block_ids, d.num_computed_tokens))
        assert by_id(out)["a"].events == []
    # Token 8 lands at position 7 (block 1); token 9 at position 8 needs block 2.
    assert diffs == [([7], [], 6), ([8], [], 7), ([9], [2], 8)]
    assert sched.requests["a"].num_computed_tokens == 9 and sched.requests["a"].num_tokens == 10


def test_long_prefill_threshold_caps_a_prompt_only_beside_decodes(make_sched: MakeSched) -> None:
    """vLLM's long_prefill_token_threshold: while "d" decodes, "long" gets at most 4 tokens a step (so the
    step carrying d's token stays short); alone, a prompt takes the whole budget (nobody to stall)."""
    sched = make_sched(long_prefill_token_threshold=4, num_blocks=16)
    add(sched, "alone", list(range(1, 13)), max_tokens=1)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"alone": 12}  # no decode running: uncapped
    add(sched, "d", [50, 51], max_tokens=20)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"d": 2}  # d's own prefill (nobody decodes yet)
    add(sched, "long", list(range(100, 114)), max_tokens=1)
    add(sched, "second", list(range(20, 26)), max_tokens=1)
    counts = []
    while "long" in sched.requests:
        so, _ = step(sched)
        counts.append(so.num_scheduled_tokens)
    assert counts == [{"d": 1, "long": 4, "second": 4}, {"d": 1, "long": 4, "second": 2},
                      {"d": 1, "long": 4}, {"d": 1, "long": 2}]


def test_chunked_prefill_under_small_budget(make_sched: MakeSched) -> None:
    sched = make_sched(max_num_batched_tokens=5)
    add(sched, "a", list(range(1, 13)), max_tokens=3)
    add(sched, "b", [50, 51, 52], max_tokens=3)
    so, out = step(sched)
    assert so.num_scheduled_tokens == {"a": 5} and out.outputs == []
    assert [n.block_ids for n in so.scheduled_new_reqs] == [[0, 1]]
    assert out.scheduler_stats is not None
    assert (out.scheduler_stats.num_prompt_tokens, out.scheduler_stats.num_generation_tokens) == (5, 0)
    so, out = step(sched)
    assert so.num_scheduled_tokens == {"a": 5} and out.outputs == []
    (d,) = so.cached_diffs()
    assert (d.new_token_ids, d.new_block_ids, d.num_computed_tokens) == ([], [2], 5)
    so, out = step(sched)  # a's last 2 prompt tokens; b is admitted with the 3 left
    assert so.num_scheduled_tokens == {"a": 2, "b": 3}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"]
    assert sorted(by_id(out)) == ["a", "b"]
    assert out.scheduler_stats is not None
    assert out.scheduler_stats.num_prompt_tokens == 5 and out.scheduler_stats.num_generation_tokens == 2
    assert out.scheduler_stats.num_scheduled_tokens == 5


def test_max_num_seqs_caps_the_batch(make_sched: MakeSched) -> None:
    sched = make_sched(max_num_seqs=2)
    for rid in "abc":
        add(sched, rid, [1, 2, 3, 4], max_tokens=1)
    so, out = step(sched)
    assert list(so.num_scheduled_tokens) == ["a", "b"] and sched.num_waiting == 1
    assert {o.request_id: o.finish_reason for o in out.outputs} == {
        "a": FinishReason.LENGTH,
        "b": FinishReason.LENGTH,
    }
    so, out = step(sched)
    assert list(so.num_scheduled_tokens) == ["c"] and so.finished_req_ids == ["a", "b"]
    assert by_id(out)["c"].finish_reason == FinishReason.LENGTH
    assert not sched.has_unfinished_requests()


# ---- preemption ------------------------------------------------------------------------------------------
def test_preempts_tail_of_running_to_head_of_waiting(make_sched: MakeSched) -> None:
    sched = make_sched(max_num_seqs=3)
    add(sched, "a", list(range(0, 8)), max_tokens=2)  # blocks 0 1
    add(sched, "b", list(range(10, 18)), max_tokens=2)  # blocks 2 3
    c = add(sched, "c", list(range(20, 32)), max_tokens=3)  # blocks 4 5 6
    add(sched, "d", list(range(40, 44)), max_tokens=1)  # waits: max_num_seqs
    so, _ = step(sched)
    assert [(n.req_id, n.block_ids) for n in so.scheduled_new_reqs] == [
        ("a", [0, 1]),
        ("b", [2, 3]),
        ("c", [4, 5, 6]),
    ]

    # Each needs a new block now; only block 7 is free. a takes it, b preempts c (the tail) and takes 6.
    so, out = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and so.preempted_req_ids == ["c"]
    assert [(d.req_id, d.new_block_ids) for d in so.cached_diffs()] == [("a", [7]), ("b", [6])]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert out.scheduler_stats is not None and out.scheduler_stats.num_preemptions == 1
    assert {o.request_id: o.finish_reason for o in out.outputs} == {
        "a": FinishReason.LENGTH,
        "b": FinishReason.LENGTH,
    }

    # c resumes in full (prompt + its output) with a prefix hit on its own blocks 4 5 (6 was taken).
    so, out = step(sched)
    assert so.finished_req_ids == ["a", "b"] and so.preempted_req_ids == []
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert new["c"].token_ids == [*range(20, 32), 7] and new["c"].num_computed_tokens == 8
    assert new["c"].block_ids == [4, 5, 7, 1] and so.num_scheduled_tokens["c"] == 5
    assert new["d"].block_ids == [0]
    assert event_types(by_id(out)["c"]) == [EventType.PREEMPTED, EventType.SCHEDULED]
    assert c.num_cached_tokens == 0  # set at the first admission only
    assert out.scheduler_stats is not None
    assert (out.scheduler_stats.prefix_cache_queries, out.scheduler_stats.prefix_cache_hits) == (
        8 + 8 + 12 + 13 + 4,
        8,
    )
    while sched.has_unfinished_requests():
        step(sched)
    assert c.output_token_ids == [7, 7, 7] and c.finish_reason == FinishReason.LENGTH


def test_request_preempting_itself_stops_the_running_pass(make_sched: MakeSched) -> None:
    sched = make_sched(max_num_seqs=3, enable_prefix_caching=False)
    add(sched, "a", list(range(12)), max_tokens=4)  # 0 1 2
    add(sched, "b", list(range(8)), max_tokens=4)  # 3 4
    c = add(sched, "c", list(range(4)), max_tokens=2)  # 5
    step(sched)
    so, _ = step(sched)  # a -> 6, b -> 7, c finds nothing left and is its own victim
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and so.preempted_req_ids == ["c"]
    assert c.status == RequestStatus.PREEMPTED and sched.num_running == 2
    assert sched.kv.pool.free_queue.block_ids() == [5]


def test_priority_policy_preempts_worst_priority_and_blocks_admission_that_step(
    make_sched: MakeSched,
) -> None:
    sched = make_sched(policy="priority", num_blocks=5, max_num_seqs=2)
    x = add(sched, "x", list(range(8)), priority=5, max_tokens=3)  # blocks 0 1
    step(sched)
    add(sched, "y", list(range(100, 108)), priority=0, max_tokens=3)
    so, _ = step(sched)  # x grows into block 2, y gets 3 4
    assert so.num_scheduled_tokens == {"x": 1, "y": 8} and sched.kv.num_free_blocks == 0
    add(sched, "z", [200, 201, 202, 203], priority=1, max_tokens=1)
    # x (scheduled first, worst priority) is undone and preempted so that y can grow into block 2.
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"y": 1} and so.preempted_req_ids == ["x"]
    assert [(d.req_id, d.new_block_ids) for d in so.cached_diffs()] == [("y", [2])]
    assert x.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["z", "x"]
    # z would fit (1 seq slot, 2 free blocks) but nothing is admitted in a step that preempted.
    assert sched.kv.num_free_blocks == 2 and sched.num_running == 1
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"y": 1, "z": 4}
    assert [n.block_ids for n in so.scheduled_new_reqs] == [[1]]
    while sched.has_unfinished_requests():
        step(sched)
    assert x.finish_reason == FinishReason.LENGTH and x.num_output_tokens == 3


def test_a_request_undone_in_its_step_is_freed_before_its_tokens_count_as_computed(
    make_sched: MakeSched,
) -> None:
    """Blocks are cached when allocated, and `KVCacheManager.free` uncaches those past
    `num_computed_tokens`. That is right only while `schedule()` advances `num_computed_tokens` after
    every preemption of the step: were it advanced at allocation, a request undone later in the same step
    would be freed with a cached block whose last K/V slot is never written (a garbage prefix hit for the
    next request with that prefix, until the block is reused)."""
    sched = make_sched(policy="priority", num_blocks=4, max_num_seqs=2)
    add(sched, "x", [10, 11, 12, 13, 14, 15], priority=5, max_tokens=8)  # blocks 0 1
    step(sched, {"x": 16})
    add(sched, "y", list(range(100, 108)), priority=0, max_tokens=8)
    step(sched, {"x": 17, "y": 108})  # x: position 6; y: blocks 2 3; no block is free now
    real_free = sched.kv.free
    freed: list[tuple[str, int, list[int]]] = []

    def free_and_look(request: Request) -> None:
        block_ids = sched.kv.get_block_ids(request.request_id)
        real_free(request)
        still_cached = [i for i in block_ids if sched.kv.pool.blocks[i].block_hash is not None]
        freed.append((request.request_id, request.num_computed_tokens, still_cached))

    sched.kv.free = free_and_look  # type: ignore[method-assign]
    # x is scheduled first and fills block 1 (position 7), then y needs a third block: x is undone.
    so, _ = step(sched, {"y": 109})
    assert so.preempted_req_ids == ["x"] and so.num_scheduled_tokens == {"y": 1}
    assert freed == [("x", 7, [0])], "block 1 was filled by a step x never ran: it must leave the cache"


def test_priority_admission_order(make_sched: MakeSched) -> None:
    sched = make_sched(policy="priority", max_num_seqs=1)
    add(sched, "low", [1, 2], priority=1, arrival=1.0, max_tokens=1)
    add(sched, "high_late", [1, 2], priority=0, arrival=3.0, max_tokens=1)
    add(sched, "high_early", [1, 2], priority=0, arrival=2.0, max_tokens=1)
    order: list[str] = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        order.extend(so.num_scheduled_tokens)
    assert order == ["high_early", "high_late", "low"]


def test_fcfs_ignores_priority(make_sched: MakeSched) -> None:
    sched = make_sched(max_num_seqs=1)
    add(sched, "first", [1, 2], priority=9, max_tokens=1)
    add(sched, "second", [1, 2], priority=0, max_tokens=1)
    order: list[str] = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        order.extend(so.num_scheduled_tokens)
    assert order == ["first", "second"]


# ---- rejection and abort ---------------------------------------------------------------------------------
def test_never_fitting_prompts_are_rejected_with_an_error(make_sched: MakeSched) -> None:
    sched = make_sched(max_model_len=16, num_blocks=3)
    add(sched, "too_long", list(range(17)))
    add(sched, "too_big", list(range(13)))  # 4 blocks of 4 > 3 blocks in the cache
    add(sched, "empty", [])
    ok = add(sched, "ok", list(range(12)), max_tokens=1)
    assert sched.num_waiting == 1 and sched.has_unfinished_requests()
    so, out = step(sched)
    assert list(so.num_scheduled_tokens) == ["ok"]
    outs = by_id(out)
    for rid, words in (("too_long", "max_model_len"), ("too_big", "whole cache"), ("empty", "empty")):
        o = outs[rid]
        assert o.finish_reason == FinishReason.ERROR and o.new_token_ids == []
        assert o.error is not None and o.error.code == ErrorCode.INVALID_ARGUMENT and words in o.error.message
        assert event_types(o) == [EventType.QUEUED, EventType.FINISHED]
    assert outs["ok"].finish_reason == FinishReason.LENGTH and ok.output_token_ids == [7]
    assert not sched.has_unfinished_requests()


def test_rejection_is_emitted_even_when_nothing_runs(make_sched: MakeSched) -> None:
    sched = make_sched(max_model_len=8)
    add(sched, "x", list(range(9)))
    assert sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.is_empty
    out = sched.update_from_output(so, EMPTY_RUN)
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("x", FinishReason.ERROR)]
    assert not sched.has_unfinished_requests()
    assert sched.update_from_output(sched.schedule(), EMPTY_RUN).outputs == []


def test_duplicate_request_id_is_rejected(make_sched: MakeSched) -> None:
    sched = make_sched()
    first = add(sched, "a", [1, 2], max_tokens=2)
    add(sched, "a", [3, 4])
    _, out = step(sched)
    errors = [o for o in out.outputs if o.error is not None]
    assert len(errors) == 1 and "already in use" in errors[0].error.message  # type: ignore[union-attr]
    assert sched.requests["a"] is first and first.output_token_ids == [7]


def test_prompt_that_fills_the_cache_ends_by_length(make_sched: MakeSched) -> None:
    sched = make_sched(num_blocks=2)  # 8 token slots, max_model_len 64
    r = add(sched, "a", list(range(8)))
    _, out = step(sched)
    assert by_id(out)["a"].finish_reason == FinishReason.LENGTH and r.output_token_ids == [7]


def test_abort_waiting_and_running(make_sched: MakeSched) -> None:
    sched = make_sched(max_num_seqs=1)
    a = add(sched, "a", list(range(6)), max_tokens=10)
    add(sched, "b", list(range(6)), max_tokens=10)
    step(sched)
    assert sched.kv.get_block_ids("a") == [0, 1]
    sched.finish_requests(["b", "unknown"])
    sched.finish_requests("a")
    assert sched.kv.num_free_blocks == 8 and not sched.requests and a.status == RequestStatus.FINISHED_ABORTED
    assert sched.has_unfinished_requests()  # the abort outputs are still to be sent
    so, out = step(sched)
    assert so.finished_req_ids == ["b", "a"] and so.is_empty
    outs = by_id(out)
    assert {rid: o.finish_reason for rid, o in outs.items()} == {
        "a": FinishReason.ABORT,
        "b": FinishReason.ABORT,
    }
    assert event_types(outs["a"])[-1] == EventType.FINISHED
    assert event_types(outs["b"]) == [EventType.QUEUED, EventType.FINISHED]
    assert not sched.has_unfinished_requests()


def test_abort_between_schedule_and_update_drops_the_sample(make_sched: MakeSched) -> None:
    sched = make_sched()
    add(sched, "a", [1, 2, 3], max_tokens=5)
    add(sched, "b", [4, 5, 6], max_tokens=5)
    so = sched.schedule()
    mro = run_model(sched, so)
    sched.finish_requests(["a"])
    out = sched.update_from_output(so, mro)
    outs = by_id(out)
    assert outs["a"].finish_reason == FinishReason.ABORT and outs["a"].new_token_ids == []
    assert outs["b"].new_token_ids == [7]


# ---- stop conditions -------------------------------------------------------------------------------------
def generate(sched: Scheduler, tokens: list[int], **kwargs: Any) -> tuple[Request, list[EngineCoreOutput]]:
    """Run one request on a scripted token stream until it finishes."""
    r = add(sched, "r", [1, 2, 3], **kwargs)
    outs: list[EngineCoreOutput] = []
    stream = iter(tokens)
    while sched.has_unfinished_requests():
        _, out = step(sched, {"r": next(stream)})
        outs.extend(out.outputs)
    return r, outs


@pytest.mark.parametrize(
    ("tokens", "kwargs", "expected_out", "reason", "stop_id"),
    [
        ([5, 2, 5], dict(eos=(2,)), [5, 2], FinishReason.STOP, 2),
        ([5, 9, 5], dict(stop_token_ids=[9]), [5, 9], FinishReason.STOP, 9),
        ([2, 2, 2, 2], dict(eos=(2,), min_tokens=3), [2, 2, 2], FinishReason.STOP, 2),
        ([9, 9, 5], dict(stop_token_ids=[9], min_tokens=2), [9, 9], FinishReason.STOP, 9),
        ([2, 2, 2, 2], dict(eos=(2,), ignore_eos=True, max_tokens=3), [2, 2, 2], FinishReason.LENGTH, None),
        ([2, 9], dict(eos=(2,), ignore_eos=True, stop_token_ids=[9]), [2, 9], FinishReason.STOP, 9),
        ([5, 5, 5, 5], dict(max_tokens=2), [5, 5], FinishReason.LENGTH, None),
        ([5, 2], dict(eos=(2,), max_tokens=2), [5, 2], FinishReason.STOP, 2),  # stop wins over length
    ],
)
def test_stop_conditions(
    make_sched: MakeSched,
    tokens: list[int],
    kwargs: dict[str, Any],
    expected_out: list[int],
    reason: FinishReason,
    stop_id: int | None,
) -> None:
    r, outs = generate(make_sched(), tokens, **kwargs)
    assert [t for o in outs for t in o.new_token_ids] == expected_out == r.output_token_ids
    assert [o.finish_reason for o in outs] == [FinishReason.UNSPECIFIED] * (len(outs) - 1) + [reason]
    assert outs[-1].stop_token_id == stop_id
    assert event_types(outs[-1])[-1] == EventType.FINISHED


def test_max_model_len_ends_by_length(make_sched: MakeSched) -> None:
    r, outs = generate(make_sched(max_model_len=6), [5] * 10)
    assert r.output_token_ids == [5, 5, 5] and r.num_tokens == 6
    assert outs[-1].finish_reason == FinishReason.LENGTH


# ---- prefix cache, logprobs, stats -----------------------------------------------------------------------
def test_prefix_hits_counted_and_reported(make_sched: MakeSched) -> None:
    sched = make_sched()
    add(sched, "a", list(range(10)), max_tokens=2)
    add(sched, "same_step", list(range(10)), max_tokens=2)  # a's blocks are cached as they are allocated
    so, out = step(sched)
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert new["a"].block_ids == [0, 1, 2] and new["same_step"].block_ids == [0, 1, 3]
    assert so.num_scheduled_tokens == {"a": 10, "same_step": 2}
    assert by_id(out)["same_step"].num_cached_tokens == 8 and by_id(out)["a"].num_cached_tokens == 0
    add(sched, "later", [*range(8), 99], max_tokens=1)
    so, out = step(sched)
    assert so.num_scheduled_tokens["later"] == 1 and so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert by_id(out)["later"].num_cached_tokens == 8
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (29, 16)


def test_no_prefix_caching(make_sched: MakeSched) -> None:
    sched = make_sched(enable_prefix_caching=False)
    add(sched, "a", list(range(10)), max_tokens=1)
    add(sched, "b", list(range(10)), max_tokens=1)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 10, "b": 10}
    assert [n.block_ids for n in so.scheduled_new_reqs] == [[0, 1, 2], [3, 4, 5]]
    assert (sched.get_stats().prefix_cache_queries, sched.get_stats().prefix_cache_hits) == (0, 0)


def test_prompt_logprobs_accumulate_over_chunks_and_go_with_the_first_token(make_sched: MakeSched) -> None:
    sched = make_sched(max_num_batched_tokens=3)
    add(sched, "a", [10, 11, 12, 13, 14], prompt_logprobs=0, logprobs=1, max_tokens=2)
    rows = {i: (10 + i, -float(i), 1, [10 + i], [-float(i)]) for i in range(1, 5)}

    so = sched.schedule()
    mro = run_model(sched, so)
    mro.prompt_logprobs = {"a": [rows[1], rows[2]]}
    assert sched.update_from_output(so, mro).outputs == []

    so = sched.schedule()
    mro = run_model(sched, so, {"a": 42})
    mro.prompt_logprobs = {"a": [rows[3], rows[4]]}
    mro.logprobs = [(-0.5, 2, [41, 42], [-0.1, -0.5])]
    (o,) = sched.update_from_output(so, mro).outputs
    assert [p.token_id for p in o.prompt_logprobs] == [11, 12, 13, 14]
    assert o.prompt_logprobs[2].logprob == -3.0
    (lp,) = o.new_logprobs
    assert (lp.token_id, lp.logprob, lp.rank, lp.top_token_ids) == (42, -0.5, 2, [41, 42])

    _, out = step(sched)
    assert out.outputs[0].prompt_logprobs == [] and out.outputs[0].finished


def test_prompt_logprobs_are_not_duplicated_by_a_preemption_mid_prefill(make_sched: MakeSched) -> None:
    sched = make_sched(num_blocks=3, max_num_batched_tokens=4, max_num_seqs=2)
    add(sched, "a", [1, 2, 3, 4], max_tokens=10)
    b = add(sched, "b", [10, 11, 12, 13, 14, 15, 16, 17], prompt_logprobs=0, max_tokens=1)
    step(sched)  # a's prompt
    so, _ = step(sched)  # a decodes; b gets a 3-token chunk (2 prompt logprobs)
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}
    so, _ = step(sched)  # b needs a block it cannot get and preempts itself
    assert so.preempted_req_ids == ["b"] and b.prompt_logprobs == []
    sched.finish_requests(["a"])
    outs: list[EngineCoreOutput] = []
    while sched.has_unfinished_requests():
        outs.extend(o for o in step(sched)[1].outputs if o.request_id == "b")
    assert [p.token_id for p in outs[0].prompt_logprobs] == b.prompt_token_ids[1:]
    assert outs[-1].finish_reason == FinishReason.LENGTH


def test_stats_reflect_load(make_sched: MakeSched) -> None:
    sched = make_sched(max_num_seqs=1)
    add(sched, "a", list(range(6)), max_tokens=3)
    add(sched, "b", list(range(6)), max_tokens=3)
    _, out = step(sched)
    stats = out.scheduler_stats
    assert stats is not None
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks, stats.num_total_blocks) == (
        1,
        1,
        6,
        8,
    )
    assert stats.kv_cache_usage == pytest.approx(2 / 8)
    assert (stats.num_scheduled_tokens, stats.num_prompt_tokens, stats.num_generation_tokens) == (6, 6, 1)
    assert sched.get_stats() == stats


# ---- a seeded soak: worker view stays consistent, everything ends once, nothing leaks ---------------------
class FakeWorker:
    """Rebuilds each request's tokens and block table from SchedulerOutputs alone, as a worker must."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.expected_computed: dict[str, int] = {}

    def apply(self, so: SchedulerOutput) -> None:
        for rid in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
            self.expected_computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.tokens
            self.tokens[new.req_id] = list(new.token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
            self.expected_computed[new.req_id] = new.num_computed_tokens
        for d in so.cached_diffs():
            self.tokens[d.req_id] += d.new_token_ids
            self.blocks[d.req_id] += d.new_block_ids
            assert d.num_computed_tokens == self.expected_computed[d.req_id]
        for rid, n in so.num_scheduled_tokens.items():
            assert len(self.blocks[rid]) * 4 >= self.expected_computed[rid] + n
            assert self.expected_computed[rid] + n <= len(self.tokens[rid])
            self.expected_computed[rid] += n


@pytest.mark.parametrize(("policy", "caching"), [("fcfs", True), ("fcfs", False), ("priority", True)])
def test_seeded_soak(make_sched: MakeSched, policy: str, caching: bool) -> None:
    rng = random.Random(1234)
    sched = make_sched(
        policy=policy,
        enable_prefix_caching=caching,
        num_blocks=12,
        max_num_batched_tokens=10,
        max_model_len=40,
    )
    worker = FakeWorker()
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    finished: dict[str, FinishReason] = {}
    added = 0
    for _ in range(400):
        if added < 40 and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(0, 10))]
            add(
                sched,
                f"r{added}",
                prompt,
                priority=rng.randrange(3),
                eos=(0,),
                max_tokens=rng.randrange(1, 12),
            )
            added += 1
        if sched.requests and rng.random() < 0.03:
            sched.finish_requests([rng.choice(sorted(sched.requests))])
        so = sched.schedule()
        worker.apply(so)
        for rid in so.num_scheduled_tokens:
            r = sched.requests[rid]
            assert worker.tokens[rid] == r.all_token_ids and worker.blocks[rid] == sched.kv.get_block_ids(rid)
        mro = run_model(sched, so, {rid: rng.randrange(60) for rid in so.num_scheduled_tokens})
        for o in sched.update_from_output(so, mro).outputs:
            if o.finished:
                assert o.request_id not in finished, "finished twice"
                finished[o.request_id] = o.finish_reason
        in_use = {b for rid in sched.requests for b in sched.kv.get_block_ids(rid)}
        assert sched.kv.num_free_blocks + len(in_use) == 12  # a block is either free or in some table
        if added == 40 and not sched.has_unfinished_requests():
            break
    assert len(finished) == added == 40
    assert sched.num_preemptions > 0
    assert sched.kv.num_free_blocks == 12
