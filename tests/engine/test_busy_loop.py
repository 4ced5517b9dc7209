"""The busy loop (engine_svc/busy_loop.py) on its own thread, in front of a fake core whose requests run
exactly as long as the test says: one token per step up to `max_tokens`, forever when it is unset.

Checked: the inbox takes typed messages only (anything else is fatal, never dropped), the state machine
SERVING -> DRAINING -> DRAINED -> STOPPED, and the invariants of its docstring: each request ends exactly
once on the stream that added it, duplicate ids and a full queue are refused, a closed stream's requests
are aborted, and a failing step fails every live request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from engine_svc.busy_loop import BusyLoop, LoopState, UnknownMessageError
from engine_svc.kv.events import KVEventLog
from shared_runtime.contract import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineSamplingParams,
    ErrorCode,
    FinishReason,
    SchedulerStats,
)
from tests.support import wait_until


@dataclass
class FakeRequest:
    request: EngineCoreRequest
    produced: int = 0
    seated: bool = False


@dataclass
class FakeScheduler:
    max_num_seqs: int
    requests: dict[str, FakeRequest] = field(default_factory=dict)

    @property
    def num_running(self) -> int:
        return sum(r.seated for r in self.requests.values())

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - self.num_running


class FakeExecutor:
    def check_health(self) -> None:
        pass


class FakeCore:
    """What BusyLoop uses of EngineCore. Aborts take effect at the next step, as in the real core."""

    def __init__(self, max_num_seqs: int = 4, fail_at_step: int | None = None) -> None:
        self.scheduler = FakeScheduler(max_num_seqs)
        self.executor = FakeExecutor()
        self.fail_at_step = fail_at_step
        self.num_steps = 0
        self._aborted: list[str] = []
        self.kv_events: KVEventLog | None = None  # what the prefix cache recorded (None: events off)
        self.grammars = SimpleNamespace(on_done=None, prewarm=lambda: None)  # on_done: the loop's inbox
        self.kv_connector = None  # no P/D disaggregation (engine_svc/kv_transfer/)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.requests[request.request_id] = FakeRequest(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._aborted += [r for r in request_ids if r in self.scheduler.requests]

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def has_work(self) -> bool:
        return self.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting)

    def step(self) -> EngineCoreOutputs:
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("the model blew up")
        if self.kv_events is not None:  # as if each step evicted one block
            self.kv_events.removed(bytes([self.num_steps]))
        requests = self.scheduler.requests
        outputs = [EngineCoreOutput(request_id=r, finish_reason=FinishReason.ABORT) for r in self._aborted]
        for rid in self._aborted:
            del requests[rid]
        self._aborted.clear()
        for rid, req in list(requests.items()):
            if not req.seated and self.scheduler.num_running < self.scheduler.max_num_seqs:
                req.seated = True
            if req.seated:
                req.produced += 1
                out = EngineCoreOutput(request_id=rid, new_token_ids=[req.produced])
                if req.produced == req.request.sampling_params.max_tokens:
                    out.finish_reason = FinishReason.LENGTH
                    del requests[rid]
                outputs.append(out)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.get_stats())


def request(request_id: str, max_tokens: int | None = None) -> EngineCoreRequest:
    """A request that runs `max_tokens` steps (None: until it is aborted)."""
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                             sampling_params=EngineSamplingParams(max_tokens=max_tokens))


class Harness:
    """A BusyLoop on a FakeCore; records what it delivers per stream and what its callbacks saw."""

    def __init__(self, core: FakeCore | None = None, **kwargs: Any) -> None:
        self.core = core or FakeCore()
        self.delivered: dict[int, list[EngineCoreOutput]] = {}
        self.fatal: list[BaseException] = []
        self.drained = 0
        self._lock = threading.Lock()
        self.loop = BusyLoop(lambda: self.core, self._deliver, on_fatal=self.fatal.append,  # type: ignore[arg-type, return-value]
                             on_drained=self._on_drained, **kwargs)

    def _deliver(self, stream_id: int, outputs: EngineCoreOutputs) -> None:
        with self._lock:
            self.delivered.setdefault(stream_id, []).extend(outputs.outputs)

    def _on_drained(self) -> None:
        self.drained += 1

    def outputs(self, stream_id: int, request_id: str) -> list[EngineCoreOutput]:
        with self._lock:
            return [o for o in self.delivered.get(stream_id, []) if o.request_id == request_id]

    def ends(self, stream_id: int, request_id: str) -> list[EngineCoreOutput]:
        return [o for o in self.outputs(stream_id, request_id) if o.finish_reason]

    def end(self, stream_id: int, request_id: str) -> EngineCoreOutput:
        """The request's one final output (waits for it; fails if there are several)."""
        wait_until(lambda: self.ends(stream_id, request_id), 10, f"{request_id} ended")
        [last] = self.ends(stream_id, request_id)
        return last

    def running(self, stream_id: int, request_id: str) -> None:
        wait_until(lambda: len(self.outputs(stream_id, request_id)) >= 2, 10, f"{request_id} running")

    def stopped(self) -> None:
        self.loop.join(10)
        assert not self.loop.is_alive(), "the busy loop did not end"


@pytest.fixture()
def harness() -> Iterator[Harness]:
    h = Harness(max_waiting=None)
    h.loop.start()
    yield h
    h.loop.stop()
    h.stopped()


def test_a_message_the_loop_does_not_know_is_fatal_not_dropped(harness: Harness) -> None:
    harness.loop.add(1, request("live"))
    harness.running(1, "live")
    harness.loop.inbox.put(("abort", 1, ["live"]))  # type: ignore[arg-type]  # the old string-tagged form
    harness.stopped()
    assert [type(e) for e in harness.fatal] == [UnknownMessageError]
    assert harness.loop.state is LoopState.STOPPED
    end = harness.end(1, "live")  # the live request still ends, once, so a client can retry elsewhere
    assert end.finish_reason == FinishReason.ERROR and end.error is not None
    assert end.error.code == ErrorCode.UNAVAILABLE


def test_drain_refuses_new_work_then_reports_drained_once_and_stays_drained(harness: Harness) -> None:
    loop = harness.loop
    loop.add(1, request("endless"))
    harness.running(1, "endless")
    assert loop.state is LoopState.SERVING
    loop.drain(grace_s=600)
    loop.add(1, request("late"))
    assert harness.end(1, "late").error.code == ErrorCode.UNAVAILABLE  # type: ignore[union-attr]
    assert loop.state is LoopState.DRAINING and harness.drained == 0
    assert not harness.ends(1, "endless"), "a drain must let running requests go on"
    loop.abort(1, ["endless"])
    wait_until(lambda: harness.drained == 1, 10, "drained")
    assert loop.state is LoopState.DRAINED
    assert harness.end(1, "endless").finish_reason == FinishReason.ABORT
    loop.drain(grace_s=600)
    loop.add(2, request("later"))
    assert harness.end(2, "later").error.code == ErrorCode.UNAVAILABLE  # type: ignore[union-attr]
    assert loop.state is LoopState.DRAINED and harness.drained == 1
    loop.stop()
    harness.stopped()
    assert loop.state is LoopState.STOPPED and not harness.fatal


def test_the_drain_deadline_fails_what_still_runs(harness: Harness) -> None:
    harness.loop.add(1, request("endless"))
    harness.running(1, "endless")
    harness.loop.drain(grace_s=0.05)
    end = harness.end(1, "endless")
    assert end.error is not None and end.error.code == ErrorCode.UNAVAILABLE and "grace" in end.error.message
    wait_until(lambda: harness.drained == 1, 10, "drained")
    assert not harness.core.has_unfinished_requests()


def test_stop_ends_each_live_request_once_on_its_own_stream(harness: Harness) -> None:
    harness.loop.add(1, request("a"))
    harness.loop.add(2, request("b"))
    harness.running(1, "a")
    harness.running(2, "b")
    harness.loop.stop()
    harness.stopped()
    for stream_id, rid in ((1, "a"), (2, "b")):
        assert harness.end(stream_id, rid).error.code == ErrorCode.UNAVAILABLE  # type: ignore[union-attr]
    assert set(harness.delivered) == {1, 2}
    assert not harness.core.has_unfinished_requests()


def test_ids_are_owned_by_the_stream_that_added_them(harness: Harness) -> None:
    loop = harness.loop
    loop.add(1, request("mine"))
    loop.add(1, request("also-mine"))
    harness.running(1, "mine")
    loop.add(2, request("mine", max_tokens=2))
    assert harness.end(2, "mine").error.code == ErrorCode.INVALID_ARGUMENT  # type: ignore[union-attr]
    loop.abort(2, ["mine"])  # not stream 2's to abort
    loop.close_stream(2)  # nor to close
    count = len(harness.outputs(1, "mine"))
    wait_until(lambda: len(harness.outputs(1, "mine")) > count + 2, 10, "stream 1's request still running")
    assert not harness.ends(1, "mine")
    loop.close_stream(1)
    assert harness.end(1, "mine").finish_reason == FinishReason.ABORT
    assert harness.end(1, "also-mine").finish_reason == FinishReason.ABORT
    wait_until(lambda: not harness.core.has_unfinished_requests(), 10, "nothing left in the core")


def test_max_waiting_counts_only_requests_beyond_the_free_seats() -> None:
    h = Harness(FakeCore(max_num_seqs=1), max_waiting=1)
    for rid in ("seated", "queued", "refused"):  # one batch: nothing has stepped in between
        h.loop.add(1, request(rid, max_tokens=3))
    h.loop.start()
    try:
        assert h.end(1, "refused").error.code == ErrorCode.RESOURCE_EXHAUSTED  # type: ignore[union-attr]
        assert h.end(1, "seated").finish_reason == FinishReason.LENGTH
        assert h.end(1, "queued").finish_reason == FinishReason.LENGTH
    finally:
        h.loop.stop()
        h.stopped()


def test_a_failing_step_fails_every_live_request_and_reports_the_error() -> None:
    h = Harness(FakeCore(fail_at_step=5))
    h.loop.add(1, request("x"))
    h.loop.add(2, request("y"))
    h.loop.start()
    h.stopped()
    assert [str(e) for e in h.fatal] == ["the model blew up"]
    for stream_id, rid in ((1, "x"), (2, "y")):
        end = h.end(stream_id, rid)
        assert end.error is not None and end.error.code == ErrorCode.UNAVAILABLE and "blew up" in end.error.message


def test_an_abort_for_a_request_its_stream_already_ended_delivers_nothing_more(harness: Harness) -> None:
    """The server ended it (its output was too large to send, so it sent an error instead): the engine
    must stop it and free it without a second end on the stream."""
    loop = harness.loop
    loop.add(1, request("ended-by-the-stream"))
    loop.add(1, request("neighbour"))
    harness.running(1, "ended-by-the-stream")
    loop.abort(1, ["ended-by-the-stream"], already_ended=True)
    wait_until(lambda: "ended-by-the-stream" not in harness.core.scheduler.requests, 10, "freed in the core")
    count = len(harness.outputs(1, "neighbour"))
    wait_until(lambda: len(harness.outputs(1, "neighbour")) > count + 2, 10, "the loop stepped on")
    assert harness.ends(1, "ended-by-the-stream") == []
    assert not harness.ends(1, "neighbour")


def test_kv_events_are_handed_off_after_each_step_slower_than_the_interval() -> None:
    core = FakeCore()
    core.kv_events = KVEventLog()
    handed: list[tuple[list[Any], SchedulerStats]] = []
    h = Harness(core, max_waiting=None, on_kv_events=lambda events, stats: handed.append((events, stats)),
                kv_events_interval_s=0.0)
    h.loop.start()
    try:
        h.loop.add(1, request("three", max_tokens=3))
        h.end(1, "three")
        wait_until(lambda: len(handed) == 3, 10, "three hand-offs")
        assert [events for events, _ in handed] == [[bytes([1])], [bytes([2])], [bytes([3])]]
        assert handed[0][1].num_running == 1 and handed[-1][1].num_running == 0  # the stats of that step
        assert len(core.kv_events) == 0
    finally:
        h.loop.stop()
        h.stopped()
    assert len(handed) == 3, "an idle loop hands nothing off"


def test_kv_events_of_short_steps_are_handed_off_together_and_at_once_when_idle() -> None:
    core = FakeCore()
    core.kv_events = KVEventLog()
    handed: list[list[Any]] = []
    h = Harness(core, max_waiting=None, on_kv_events=lambda events, stats: handed.append(events),
                kv_events_interval_s=3600.0)
    h.loop.start()
    try:
        h.loop.add(1, request("five", max_tokens=5))
        h.end(1, "five")
        wait_until(lambda: len(handed) == 2, 10, "two hand-offs")
        assert handed == [[bytes([1])], [bytes([2]), bytes([3]), bytes([4]), bytes([5])]]  # the first, then idle
    finally:
        h.loop.stop()
        h.stopped()
