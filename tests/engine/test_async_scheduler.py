"""The scheduler with steps in flight (async scheduling and the batch queue), without a model.

A `ScriptedWorker` stands in for the workers: it keeps what a worker keeps of each request (its known
length, placeholders included), samples a request's next scripted token when its scheduled tokens reach
that length, and checks that every placeholder stands for a token it sampled in its previous step (the
invariant engine_svc/worker/sampled_feed.py relies on). The tests interleave `schedule` and
`update_from_output` as the engine core's batch queue does, and check exact token lists, step sizes,
finish reasons and block ids.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from engine_svc.request import Request, RequestStatus
from engine_svc.sched.output import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput
from engine_svc.sched.scheduler import Scheduler
from shared_runtime.contract import EngineCoreOutputs, EngineCoreRequest, EngineSamplingParams, FinishReason


class ScriptedWorker:
    """A fake worker: request r's k-th sample is script[r][k] (then 100 + k)."""

    def __init__(self, script: dict[str, list[int]]) -> None:
        self.script = script
        self.length: dict[str, int] = {}
        self.num_sampled: dict[str, int] = defaultdict(int)
        self.prev: set[str] = set()  # the requests that sampled in the previous step
        self.num_placeholders = 0
        self.prompts: dict[str, list[int]] = {}  # requests that asked for prompt logprobs: their prompt

    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for r in so.finished_req_ids + so.preempted_req_ids:
            self.length.pop(r, None)
        computed: dict[str, int] = {}
        placeholders: list[str] = []
        for new in so.scheduled_new_reqs:
            assert PLACEHOLDER_TOKEN not in new.token_ids
            self.length[new.req_id] = len(new.token_ids)
            computed[new.req_id] = new.num_computed_tokens
            if new.sampling_params.prompt_logprobs is not None:
                self.prompts[new.req_id] = new.token_ids[: new.num_prompt_tokens]
        for diff in so.cached_diffs():
            tokens = diff.new_token_ids
            assert PLACEHOLDER_TOKEN not in tokens[:-1], "a placeholder is only ever a diff's last token"
            self.length[diff.req_id] += len(tokens)
            computed[diff.req_id] = diff.num_computed_tokens
            if tokens and tokens[-1] == PLACEHOLDER_TOKEN:
                placeholders.append(diff.req_id)
        for r in placeholders:
            assert r in self.prev, f"placeholder for {r}, which did not sample in the previous step"
        self.num_placeholders += len(placeholders)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for r in req_ids:
            if computed[r] + so.num_scheduled_tokens[r] >= self.length[r]:
                k = self.num_sampled[r]
                self.num_sampled[r] += 1
                script = self.script.get(r, [])
                sampled.append(script[k] if k < len(script) else 100 + k)
            else:
                sampled.append(-1)
        if so.total_num_scheduled_tokens:
            self.prev = {r for r, t in zip(req_ids, sampled) if t >= 0}
        prompt_logprobs = {}  # row p predicts prompt token p + 1: (token, logprob -p, rank 1, no top)
        for r in req_ids:
            prompt = self.prompts.get(r)
            start, end = computed[r], min(computed[r] + so.num_scheduled_tokens[r], len(prompt or []) - 1)
            if prompt is not None and end > start:
                prompt_logprobs[r] = [(prompt[p + 1], -float(p), 1, [], []) for p in range(start, end)]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, prompt_logprobs=prompt_logprobs)


def make_scheduler(num_blocks: int = 32, caching: bool = False, **kw: Any) -> Scheduler:
    args: dict[str, Any] = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                num_blocks=num_blocks, enable_prefix_caching=caching, async_scheduling=True)
    return Scheduler(**{**args, **kw})


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 8, eos: tuple[int, ...] = (),
        arrival: float = 0.0, **params: Any) -> None:
    req = EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, eos_token_ids=list(eos), arrival_time=arrival,
                            sampling_params=EngineSamplingParams(max_tokens=max_tokens, **params))
    s.add_request(Request(req, s.max_model_len))


def drain(s: Scheduler, w: ScriptedWorker, in_flight: list[SchedulerOutput], depth: int = 2) -> list[EngineCoreOutputs]:
    """Step until nothing is left, as the engine core's batch queue does (`in_flight`: oldest first)."""
    outs = []
    while s.has_unfinished_requests() or in_flight:
        so = s.schedule()
        if not so.is_empty or so.finished_req_ids or so.preempted_req_ids:
            in_flight.append(so)
            if len(in_flight) < depth and not so.is_empty:
                continue
        elif not in_flight:
            outs.append(s.update_from_output(so, w.run(so)))
            continue
        oldest = in_flight.pop(0)
        outs.append(s.update_from_output(oldest, w.run(oldest)))
    return outs


def tokens_of(out: EngineCoreOutputs) -> dict[str, list[int]]:
    return {o.request_id: o.new_token_ids for o in out.outputs}


def finish_of(out: EngineCoreOutputs) -> dict[str, FinishReason]:
    return {o.request_id: o.finish_reason for o in out.outputs if o.finish_reason}


def test_a_decode_is_scheduled_on_a_placeholder_and_a_length_finish_wastes_no_step() -> None:
    s, w = make_scheduler(), ScriptedWorker({"r": [10, 11, 12]})
    add(s, "r", [1, 2, 3, 4, 5], max_tokens=3)
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"r": 5} and s.requests["r"].num_output_placeholders == 1
    so2 = s.schedule()  # before step 1's token is known: the next decode runs on a placeholder
    assert (so2.decode_req_ids, so2.decode_token_ids, so2.decode_num_computed_tokens) == (["r"], [PLACEHOLDER_TOKEN], [5])
    assert s.requests["r"].num_output_placeholders == 2
    assert tokens_of(s.update_from_output(so1, w.run(so1))) == {"r": [10]}
    so3 = s.schedule()
    assert so3.decode_token_ids == [PLACEHOLDER_TOKEN] and so3.decode_num_computed_tokens == [6]
    assert tokens_of(s.update_from_output(so2, w.run(so2))) == {"r": [11]}
    so4 = s.schedule()  # the token in flight (step 3's) is the last max_tokens allows: no step for it
    assert so4.is_empty
    out = s.update_from_output(so3, w.run(so3))
    assert tokens_of(out) == {"r": [12]} and finish_of(out) == {"r": FinishReason.LENGTH}
    assert w.num_placeholders == 2
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.requests and not s._stale


def test_an_eos_in_flight_wastes_one_step_and_nothing_past_it_is_emitted() -> None:
    s, w = make_scheduler(), ScriptedWorker({"r": [10, 7, 12, 13]})
    add(s, "r", [1, 2, 3, 4, 5], max_tokens=8, eos=(7,))
    so1, so2 = s.schedule(), s.schedule()
    s.update_from_output(so1, w.run(so1))
    so3 = s.schedule()  # scheduled for r before step 2's EOS is known
    assert so3.num_scheduled_tokens == {"r": 1}
    out = s.update_from_output(so2, w.run(so2))
    assert tokens_of(out) == {"r": [7]} and finish_of(out) == {"r": FinishReason.STOP}
    assert out.outputs[0].stop_token_id == 7
    assert s.kv.num_free_blocks == s.kv.num_blocks  # freed at once, while step 3 is in flight
    so4 = s.schedule()
    assert so4.finished_req_ids == ["r"] and so4.is_empty  # the workers drop it
    late = w.run(so3)
    assert late.req_ids == ["r"] and late.sampled_token_ids == [12]  # the wasted step did sample
    assert s.update_from_output(so3, late).outputs == []  # ... and nothing of it is emitted
    assert not s._stale


def test_a_request_preempted_while_its_sample_is_in_flight_keeps_that_token_and_waits_for_it() -> None:
    # 2 blocks of 4: both prompts fit; a's first decode needs a block, so b (the tail) is preempted while
    # its prefill's sample is still in flight.
    s = make_scheduler(num_blocks=2)
    w = ScriptedWorker({"a": [20, 21, 22], "b": [30, 31, 32]})
    add(s, "a", [1, 2, 3, 4], max_tokens=3, arrival=0.0)
    add(s, "b", [5, 6, 7, 8], max_tokens=3, arrival=1.0)
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"a": 4, "b": 4}
    so2 = s.schedule()
    assert so2.preempted_req_ids == ["b"] and s.requests["b"].status == RequestStatus.PREEMPTED
    s.finish_requests(["a"])  # free a's blocks: b could be admitted now, but its sample is still in flight
    so3 = s.schedule()
    assert so3.scheduled_new_reqs == [] and so3.is_empty  # (a depth-3 queue: steps 1 and 2 unapplied)
    out = s.update_from_output(so1, w.run(so1))
    assert tokens_of(out) == {"a": [], "b": [30]}  # a was aborted: its step-1 token is dropped; b's stands
    assert finish_of(out) == {"a": FinishReason.ABORT}
    assert s.requests["b"].output_token_ids == [30] and s.requests["b"].status == RequestStatus.PREEMPTED
    s.update_from_output(so2, w.run(so2))
    s.update_from_output(so3, w.run(so3))
    so4 = s.schedule()
    assert [(n.req_id, n.token_ids, n.num_computed_tokens) for n in so4.scheduled_new_reqs] == [
        ("b", [5, 6, 7, 8, 30], 0)]
    so5 = s.schedule()
    assert so5.decode_req_ids == ["b"] and so5.decode_token_ids == [PLACEHOLDER_TOKEN]
    assert tokens_of(s.update_from_output(so4, w.run(so4))) == {"b": [31]}
    out = s.update_from_output(so5, w.run(so5))
    assert tokens_of(out) == {"b": [32]} and finish_of(out) == {"b": FinishReason.LENGTH}
    assert s.kv.num_free_blocks == 2 and not s.requests


def test_a_request_preempted_with_its_first_token_in_flight_keeps_every_prompt_logprob() -> None:
    # 3 blocks of 4, 8 tokens a step: b's prompt goes in two chunks; a's decode at position 4 needs a third
    # block while b's last chunk (which samples its first token) is in flight, so b is preempted then.
    s = make_scheduler(num_blocks=3, max_num_batched_tokens=8)
    w = ScriptedWorker({"a": [20, 21, 22, 23, 24], "b": [30, 31]})
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    add(s, "a", [1, 2, 3], max_tokens=5, arrival=0.0)
    add(s, "b", prompt, max_tokens=2, arrival=1.0, prompt_logprobs=1)
    so1, so2 = s.schedule(), s.schedule()
    assert so1.num_scheduled_tokens == {"a": 3, "b": 5} and so2.num_scheduled_tokens == {"a": 1, "b": 3}
    s.update_from_output(so1, w.run(so1))  # b's first chunk's rows
    so3 = s.schedule()
    assert so3.preempted_req_ids == ["b"] and s.requests["b"].num_output_placeholders == 1
    out = s.update_from_output(so2, w.run(so2))  # b's last chunk's rows and its first token
    first = next(o for o in out.outputs if o.request_id == "b")
    assert first.new_token_ids == [30]
    assert [(lp.token_id, lp.logprob) for lp in first.prompt_logprobs] == [(prompt[p + 1], -p) for p in range(7)]
    outs = drain(s, w, [so3])
    assert [t for o in outs for r in o.outputs if r.request_id == "b" for t in r.new_token_ids] == [31]
    assert all(not r.prompt_logprobs for o in outs for r in o.outputs)  # the recomputed prompt sends none
    assert s.kv.num_free_blocks == 3


def test_a_preempted_request_whose_token_in_flight_ends_it_leaves_the_waiting_queue() -> None:
    s = make_scheduler(num_blocks=2)
    w = ScriptedWorker({"a": [20, 21], "b": [9]})
    add(s, "a", [1, 2, 3, 4], max_tokens=2, arrival=0.0)
    add(s, "b", [5, 6, 7, 8], max_tokens=3, eos=(9,), arrival=1.0)
    so1, so2 = s.schedule(), s.schedule()
    assert so2.preempted_req_ids == ["b"]
    out = s.update_from_output(so1, w.run(so1))
    assert finish_of(out) == {"b": FinishReason.STOP} and tokens_of(out)["b"] == [9]
    assert len(s.waiting) == 0 and "b" not in s.requests
    s.update_from_output(so2, w.run(so2))
    assert s.kv.num_free_blocks == 2 and not s.has_unfinished_requests()


def test_outputs_of_an_ended_request_are_not_given_to_a_new_one_with_its_id() -> None:
    s, w = make_scheduler(), ScriptedWorker({"r": [10, 7, 12]})
    add(s, "r", [1, 2, 3], max_tokens=8, eos=(7,))
    so1, so2 = s.schedule(), s.schedule()
    s.update_from_output(so1, w.run(so1))
    so3 = s.schedule()
    assert finish_of(s.update_from_output(so2, w.run(so2))) == {"r": FinishReason.STOP}
    assert s._stale == {"r": 3}
    w.script["r"] = [10, 7, 12, 50, 51]  # the new r's samples (the worker counts on from the old one's)
    add(s, "r", [4, 5, 6], max_tokens=2)  # the id again, while step 3 (old r's wasted decode) is in flight
    so4 = s.schedule()
    assert [n.req_id for n in so4.scheduled_new_reqs] == ["r"]
    assert s.update_from_output(so3, w.run(so3)).outputs == []  # old r's token: not the new r's
    assert s.requests["r"].output_token_ids == [] and not s._stale
    so5 = s.schedule()
    assert tokens_of(s.update_from_output(so4, w.run(so4))) == {"r": [50]}
    out = s.update_from_output(so5, w.run(so5))
    assert tokens_of(out) == {"r": [51]} and finish_of(out) == {"r": FinishReason.LENGTH}


def test_a_block_filled_by_a_placeholder_is_cached_once_its_token_is_known() -> None:
    s, w = make_scheduler(caching=True), ScriptedWorker({"r": [40, 41, 42]})
    add(s, "r", [1, 2, 3], max_tokens=3)
    so1, so2 = s.schedule(), s.schedule()  # step 2 computes position 3 (a placeholder): block 0 is full
    block0 = s.kv.get_block_ids("r")[0]
    assert s.kv.pool.blocks[block0].block_hash is None  # no hash over an unknown token
    s.update_from_output(so1, w.run(so1))  # token 40 is known now
    assert s.kv.pool.blocks[block0].block_hash == s.requests["r"].block_hashes[0]
    assert s.kv.pool.blocks[block0].token_ids == (1, 2, 3, 40)
    drain(s, w, [so2])
    add(s, "q", [1, 2, 3, 40, 41])
    s.schedule()
    assert s.requests["q"].num_cached_tokens == 4 and s.kv.get_block_ids("q")[0] == block0


def test_without_async_scheduling_a_deeper_queue_only_takes_other_requests() -> None:
    s = make_scheduler(async_scheduling=False, max_num_batched_tokens=8)
    s.steps_in_flight = True  # (a queue deeper than one batch, as the engine core sets it)
    w = ScriptedWorker({"a": [10, 11], "b": [20, 21]})
    add(s, "a", [1, 2, 3], max_tokens=2, arrival=0.0)
    add(s, "b", [4, 5, 6, 7, 8, 9, 10, 11], max_tokens=2, arrival=1.0)
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"a": 3, "b": 5}
    so2 = s.schedule()  # a's token is in flight, so a has nothing to run; b's prompt goes on
    assert so2.num_scheduled_tokens == {"b": 3} and w.num_placeholders == 0
    drain(s, w, [so1, so2], depth=3)
    assert w.num_placeholders == 0 and s.kv.num_free_blocks == s.kv.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_step_stats_count_each_updated_step_once(async_scheduling: bool) -> None:
    s, w = make_scheduler(async_scheduling=async_scheduling), ScriptedWorker({})
    add(s, "r", [1, 2, 3], max_tokens=4)
    add(s, "q", [4, 5], max_tokens=3)
    outs = drain(s, w, [], depth=2 if async_scheduling else 1)
    assert sum(o.scheduler_stats.num_generation_tokens for o in outs) == 7
    assert sum(len(o.new_token_ids) for out in outs for o in out.outputs) == 7
    assert s.get_stats(with_step=False).num_scheduled_tokens == 0
