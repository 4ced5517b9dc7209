"""The scheduler's side of speculative decoding, driven by fake verification results: 1 + k tokens
scheduled and budgeted, KV slots allocated for the drafts, rejected drafts' positions given back, a
stop token or max_tokens inside an accepted run, preemption with drafts scheduled, every block back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine_svc.sched.output import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput
from engine_svc.sched.scheduler import Scheduler
from engine_svc.spec.config import SpeculativeConfig
from engine_svc.spec.proposers import PENDING_DRAFT
from shared_runtime.contract import FinishReason
from tests.engine.test_scheduler import EMPTY_RUN, MakeSched, add, step

NGRAM = SpeculativeConfig("ngram", 3, 1, 2)


def verified(so: SchedulerOutput, runs: dict[str, list[int]]) -> ModelRunnerOutput:
    """The model's output for a step: each request in `runs` yields that run (accepted drafts + one)."""
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[runs[r][0] for r in req_ids],
                             spec_token_ids={r: runs[r] for r in req_ids if r in so.scheduled_spec_decode_tokens})


@pytest.fixture
def make_sched() -> Iterator[MakeSched]:
    """Schedulers with NGRAM speculation (test_scheduler.py's sizes); on teardown every block is free."""
    made: list[Scheduler] = []

    def make(**overrides: Any) -> Scheduler:
        kwargs: dict[str, Any] = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                      num_blocks=8, speculative=NGRAM)
        made.append(Scheduler(**{**kwargs, **overrides}))
        return made[-1]

    yield make
    for sched in made:
        sched.finish_requests(list(sched.requests))
        sched.update_from_output(sched.schedule(), EMPTY_RUN)
        assert sched.kv.num_free_blocks == sched.kv.num_blocks, "KV blocks leaked"


def sched_with(make_sched: MakeSched, **overrides: Any) -> Scheduler:
    return make_sched(**overrides)


def test_drafts_are_scheduled_allocated_and_rolled_back(make_sched: MakeSched) -> None:
    sched = sched_with(make_sched)
    req = add(sched, "a", [1, 2, 3, 1, 2], max_tokens=20)
    step(sched, {"a": 3})  # prefill; samples 3 -> tokens 1 2 3 1 2 3: "2 3" matched at 1..2 -> drafts 1 2 3
    assert req.spec_token_ids == [1, 2, 3]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert req.num_computed_tokens == 9 and sched.kv.get_block_ids("a") == [0, 1, 2]  # slots for 9 tokens
    out = sched.update_from_output(so, verified(so, {"a": [1, 9]}))  # 1 accepted, 2 rejected, 9 sampled
    assert out.outputs[0].new_token_ids == [1, 9]
    assert req.num_computed_tokens == 7 and req.num_tokens == 8  # the rejected drafts' positions given back
    assert sched.spec_stats.num_drafts == 1 and sched.spec_stats.num_draft_tokens == 3
    assert sched.spec_stats.num_accepted_tokens == 1 and sched.spec_stats.accepted_per_pos == [1, 0, 0]
    assert sched.get_stats().num_generation_tokens == 2
    so = sched.schedule()  # no 2-gram "1 9" / 1-gram "9" seen before: a plain decode
    assert so.num_scheduled_tokens == {"a": 1} and not so.scheduled_spec_decode_tokens


def test_the_budget_cuts_drafts(make_sched: MakeSched) -> None:
    sched = sched_with(make_sched, max_num_batched_tokens=8)
    add(sched, "a", [1, 2, 1], max_tokens=20)
    add(sched, "b", [5, 6, 5], max_tokens=20)
    step(sched, {"a": 2, "b": 6})  # drafts [1, 2] for a... and [5, 6] for b
    so = sched.schedule()
    assert so.total_num_scheduled_tokens <= 8
    assert so.num_scheduled_tokens == {"a": 3, "b": 3}
    sched.update_from_output(so, verified(so, {"a": [1, 2, 1], "b": [7]}))
    assert sched.requests["b"].num_computed_tokens == 4  # 2 rejected: back to its known tokens but the last


def test_a_stop_token_inside_an_accepted_run_ends_it_there(make_sched: MakeSched) -> None:
    sched = sched_with(make_sched)
    add(sched, "a", [1, 2, 3, 1, 2], max_tokens=20, stop_token_ids=[2])
    step(sched, {"a": 3})
    so = sched.schedule()
    out = sched.update_from_output(so, verified(so, {"a": [1, 2, 3, 4]}))  # all 3 accepted + bonus
    (o,) = out.outputs
    assert o.new_token_ids == [1, 2] and o.finish_reason == FinishReason.STOP and o.stop_token_id == 2
    assert "a" not in sched.requests and sched.kv.num_free_blocks == sched.kv.num_blocks


def test_drafts_never_pass_max_tokens(make_sched: MakeSched) -> None:
    sched = sched_with(make_sched)
    req = add(sched, "a", [1, 2, 3, 1, 2], max_tokens=3)
    step(sched, {"a": 3})  # 1 output; 2 more allowed: at most 1 draft + the sampled token
    assert req.spec_token_ids == [1]
    so = sched.schedule()
    out = sched.update_from_output(so, verified(so, {"a": [1, 5]}))
    (o,) = out.outputs
    assert o.new_token_ids == [1, 5] and o.finish_reason == FinishReason.LENGTH


def test_preemption_with_drafts_scheduled_returns_every_block(make_sched: MakeSched) -> None:
    """Two requests verifying drafts in a 5-block cache: the later one is preempted while the earlier
    one's drafts need a block; both finish with plain-decoding semantics and the cache is whole again."""
    sched = sched_with(make_sched, num_blocks=5)
    a = add(sched, "a", [1, 2, 3, 1, 2, 3, 1], max_tokens=12)
    b = add(sched, "b", [4, 5, 6, 4, 5, 6, 4], max_tokens=12)
    step(sched, {"a": 2, "b": 5})
    preempted = 0
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        preempted += len(so.preempted_req_ids)
        runs = {r: [*so.scheduled_spec_decode_tokens.get(r, [])[:1], 8] for r in so.num_scheduled_tokens}
        sched.update_from_output(so, verified(so, runs))
    assert preempted > 0 and not sched.has_unfinished_requests()
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


# ---- async scheduling: draft places over the step in flight ---------------------------------------------
def diffs(so: SchedulerOutput) -> list[tuple[str, list[int], int]]:
    return [(d.req_id, d.new_token_ids, d.num_computed_tokens) for d in so.cached_diffs()]


def test_async_places_are_reconciled_and_each_run_reaches_the_workers_once(make_sched: MakeSched) -> None:
    """Under async scheduling: 1 + k places over the token in flight, a verifying step counted as if all
    its places were accepted, its rejected places given back when its run arrives, and the next diff
    carrying one placeholder for that run (the workers expand it themselves: spec_async.py)."""
    sched = make_sched(async_scheduling=True, num_blocks=16)
    req = add(sched, "a", [1, 2, 3, 4, 5], max_tokens=12)
    s1 = sched.schedule()  # the prefill; its token is in flight
    s2 = sched.schedule()
    assert s2.num_scheduled_tokens == {"a": 4} and s2.scheduled_spec_decode_tokens == {"a": [PENDING_DRAFT] * 3}
    assert diffs(s2) == [("a", [PLACEHOLDER_TOKEN], 5)]
    assert (req.num_computed_tokens, req.num_output_placeholders, req.num_spec_in_flight) == (9, 5, 3)
    sched.update_from_output(s1, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[6]))
    s3 = sched.schedule()  # s2 in flight: one placeholder for its whole run, then 3 new places
    assert s3.num_scheduled_tokens == {"a": 4}
    assert diffs(s3) == [("a", [PLACEHOLDER_TOKEN], 9)]  # computed as if s2's places were all accepted
    out = sched.update_from_output(s2, verified(s2, {"a": [7, 8]}))  # 1 of 3 accepted
    assert out.outputs[0].new_token_ids == [7, 8] and req.all_token_ids[5:] == [6, 7, 8]
    # s3 runs positions 7..10 (the workers correct them): exact once s2's 2 rejected places are given back.
    assert (req.num_computed_tokens, req.num_output_placeholders, req.num_spec_in_flight) == (11, 4, 3)
    assert sched._num_tokens_sent["a"] == 8  # the workers hold 1..8 once s3's placeholder is expanded
    stats = sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    no_drafts = verified(s3, {"a": [9]})
    no_drafts.spec_num_drafts = {"a": 0}  # the workers found no draft for s3's places: all 3 given back
    sched.update_from_output(s3, no_drafts)
    assert (req.num_computed_tokens, req.num_output_placeholders, req.num_spec_in_flight) == (8, 0, 0)
    assert req.num_tokens == 9
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)  # not a verification


def test_async_run_of_a_request_left_out_of_the_next_step_goes_in_its_diff(make_sched: MakeSched) -> None:
    """A request whose places in flight reach max_tokens is left out of the next step; its run then
    reaches the workers as real tokens in its next diff, not as a placeholder."""
    sched = make_sched(async_scheduling=True, num_blocks=16)
    req = add(sched, "a", [1, 2, 3, 4, 5], max_tokens=5)  # at most 10 tokens
    s1 = sched.schedule()
    s2 = sched.schedule()  # 3 places: if all accepted, the request reaches 10 tokens
    assert s2.scheduled_spec_decode_tokens == {"a": [PENDING_DRAFT] * 3}
    sched.update_from_output(s1, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[6]))
    s3 = sched.schedule()
    assert "a" not in s3.num_scheduled_tokens  # its token in flight may end it
    sched.update_from_output(s3, EMPTY_RUN)
    sched.update_from_output(s2, verified(s2, {"a": [7, 8]}))
    s4 = sched.schedule()
    assert diffs(s4) == [("a", [7, 8], 7)]
    assert s4.num_scheduled_tokens == {"a": 2} and s4.scheduled_spec_decode_tokens == {"a": [PENDING_DRAFT]}
    sched.update_from_output(s4, verified(s4, {"a": [9, 10]}))
    assert req.is_finished and req.output_token_ids == [6, 7, 8, 9, 10]
