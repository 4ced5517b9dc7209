"""The EngineCore busy loop: one thread that owns the core and talks to the gRPC side through queues.

Inputs arrive on `inbox` (a thread-safe queue) as typed messages (`Add`, `Abort`, `CloseStream`, `Drain`,
`Stop`, `Wake` from the grammar compilers when a structured-output constraint is ready, and `Call`: a
function of the core run between steps); outputs leave through `deliver(stream_id, EngineCoreOutputs)`, called once per step for every
stream that owns a request with something to report. Serialization to protobuf happens on the receiving
(asyncio) side, not here. When the core records KV-cache events, the loop hands what was recorded to
`on_kv_events(events, stats)` through a `KVEventHandOff` (engine_svc/kv/events.py): after each step, or
every `kv_events_interval_s` when steps are shorter, and at once when idle (a list swap and one call; the
receiver numbers, converts and fans them out off this thread).

The loop is in one `LoopState` at a time: SERVING -> DRAINING (on `Drain`) -> DRAINED (nothing left in
flight; `on_drained` is called once) -> STOPPED (on `Stop`, from any state; the loop returns).

Invariants:
- Every request added through `add` ends exactly once on the stream that added it: finished, aborted,
  rejected, drained or failed. When a stream closes, all of its requests are aborted in the core.
- Request ids are unique per engine while live; a duplicate is rejected on the stream that sent it.
- While DRAINING or DRAINED every new request is refused with UNAVAILABLE (a drained engine never takes
  work again); at the drain deadline whatever is still running ends with UNAVAILABLE.
- With `max_waiting`, a request is refused with RESOURCE_EXHAUSTED when that many requests already wait
  beyond the seats the next step can fill.
- After a fatal error the loop stops stepping, ends every live request with UNAVAILABLE, and calls
  `on_fatal`; it never hangs the gRPC side. A message the loop does not know is such an error (a bug in
  the caller): it is never dropped silently.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from engine_svc.core import EngineCore
from engine_svc.kv.events import HAND_OFF_INTERVAL_S, KVEvent, KVEventHandOff
from shared_runtime.contract import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineError,
    ErrorCode,
    FinishReason,
    SchedulerStats,
)

logger = logging.getLogger(__name__)

Deliver = Callable[[int, EngineCoreOutputs], None]
HEALTH_CHECK_INTERVAL_S = 1.0  # how often an idle loop checks that its workers are alive


# ---- the inbox's messages -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Add:
    """Add `request` on behalf of stream `stream_id`."""

    stream_id: int
    request: EngineCoreRequest


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort those of `request_ids` that stream `stream_id` owns (others' ids are ignored).

    `already_ended`: the stream has already sent these requests' final output itself (an output it could
    not send became an error): the loop forgets them before aborting, so nothing more is delivered."""

    stream_id: int
    request_ids: tuple[str, ...]
    already_ended: bool = False


@dataclass(frozen=True, slots=True)
class CloseStream:
    """The stream ended: abort every request it owns."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Refuse new requests; let the running ones finish for `grace_s` seconds, then fail the rest."""

    grace_s: float


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop; requests still in flight end with UNAVAILABLE."""


@dataclass(frozen=True, slots=True)
class Wake:
    """A grammar compile finished (engine_svc/structured/): a request may be ready to schedule."""


@dataclass(frozen=True, slots=True)
class Call:
    """Run `fn(core)` on the loop's thread between steps (run-time LoRA changes, engine_svc/api/lora_admin.py);
    its result, or the exception it raised, goes to `future`. It must be quick: no file reads."""

    fn: Callable[[EngineCore], object]
    future: concurrent.futures.Future[object]


Message = Add | Abort | CloseStream | Drain | Stop | Wake | Call


class UnknownMessageError(TypeError):
    """Something that is not a `Message` reached the inbox: a programming error, fatal to the loop."""


class LoopState(enum.Enum):
    SERVING = "serving"  # taking requests
    DRAINING = "draining"  # refusing new requests; the running ones may finish until the deadline
    DRAINED = "drained"  # nothing in flight after a drain; still refusing
    STOPPED = "stopped"  # the loop has ended (or is ending)


def _error_output(request_id: str, code: ErrorCode, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, finish_reason=FinishReason.ERROR,
                            error=EngineError(code=code, message=message))


class BusyLoop(threading.Thread):
    def __init__(self, make_core: Callable[[], EngineCore], deliver: Deliver, *,
                 max_waiting: int | None = None,
                 on_ready: Callable[[EngineCore], None] = lambda core: None,
                 on_fatal: Callable[[BaseException], None] = lambda exc: None,
                 on_drained: Callable[[], None] = lambda: None,
                 on_step: Callable[[SchedulerStats | None], None] | None = None,
                 on_kv_events: Callable[[list[KVEvent], SchedulerStats], None] | None = None,
                 kv_events_interval_s: float = HAND_OFF_INTERVAL_S) -> None:
        super().__init__(name="engine-busy-loop", daemon=True)
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._make_core = make_core
        self._deliver = deliver
        self._max_waiting = max_waiting
        self._on_ready, self._on_fatal, self._on_drained = on_ready, on_fatal, on_drained
        self._on_step = on_step  # per-step stats hook (metrics); must be cheap, it runs on this thread
        self._on_kv_events = on_kv_events  # hand-off of the prefix cache's changes; must be cheap too
        self._kv_events_interval_s = kv_events_interval_s
        self._kv_hand_off: KVEventHandOff | None = None
        self.core: EngineCore | None = None
        self.stats = SchedulerStats()  # the latest; read by GetLoad from other threads
        self.state = LoopState.SERVING  # written by this thread only
        self._owner: dict[str, int] = {}  # live request id -> stream id
        self._drain_deadline = float("inf")

    # ---- called from other threads --------------------------------------------------------
    def add(self, stream_id: int, request: EngineCoreRequest) -> None:
        self.inbox.put(Add(stream_id, request))

    def abort(self, stream_id: int, request_ids: list[str], *, already_ended: bool = False) -> None:
        self.inbox.put(Abort(stream_id, tuple(request_ids), already_ended))

    def close_stream(self, stream_id: int) -> None:
        self.inbox.put(CloseStream(stream_id))

    def drain(self, grace_s: float) -> None:
        self.inbox.put(Drain(grace_s))

    def stop(self) -> None:
        self.inbox.put(Stop())

    def call(self, fn: Callable[[EngineCore], object]) -> concurrent.futures.Future[object]:
        """`fn(core)` run on the loop's thread; its future (never resolved if the loop has stopped)."""
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self.inbox.put(Call(fn, future))
        return future

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.core = self._make_core()
            self.stats = self.core.get_stats()
        except BaseException as exc:
            logger.exception("engine failed to start")
            self.state = LoopState.STOPPED
            self._on_fatal(exc)
            return
        self.core.grammars.on_done = self._wake
        if self.core.kv_connector is not None:
            self.core.kv_connector.set_wake(self._wake)  # a pull or a lease ended
        self.core.grammars.prewarm()
        self._on_ready(self.core)
        try:
            self._loop(self.core)
        except BaseException as exc:
            logger.exception("engine step failed; failing every live request")
            self.state = LoopState.STOPPED
            self._fail_all(f"engine failed: {type(exc).__name__}: {exc}")
            self._on_fatal(exc)

    def _wake(self) -> None:
        self.inbox.put(Wake())

    def _loop(self, core: EngineCore) -> None:
        if core.kv_events is not None and self._on_kv_events is not None:
            self._kv_hand_off = KVEventHandOff(core.kv_events, self._on_kv_events,  # type: ignore[arg-type]
                                               self._kv_events_interval_s)
        while True:  # until Stop (the only way out but an exception)
            idle = not core.has_work()  # requests waiting only for a grammar compile: wait for Wake
            if not self._process_inbox(core, block=idle) and idle:
                core.executor.check_health()  # notice a dead worker without waiting for a step
            if self.state is LoopState.STOPPED:
                if self._owner:  # stopped with requests in flight: each still ends exactly once
                    self._fail_all("engine stopped before this request finished", abort_in=core)
                return
            if core.has_work():
                outputs = core.step()
                self.stats = outputs.scheduler_stats or self.stats
                if self._on_step is not None:
                    self._on_step(outputs.scheduler_stats)
                self._route(outputs)
            if self._kv_hand_off is not None:
                self._kv_hand_off(self.stats, idle=not core.has_unfinished_requests())
            if self.state is LoopState.DRAINING:
                self._check_drain(core)

    def _process_inbox(self, core: EngineCore, block: bool) -> bool:
        """Handle every queued input; when `block`, wait (bounded) for the first. False if none came."""
        try:
            message = self.inbox.get(timeout=self._idle_timeout()) if block else self.inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._handle(core, message)
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _idle_timeout(self) -> float:
        if self.state is not LoopState.DRAINING:
            return HEALTH_CHECK_INTERVAL_S
        return max(0.001, min(0.05, self._drain_deadline - time.monotonic()))

    def _handle(self, core: EngineCore, message: Message) -> None:
        match message:
            case Add(stream_id, request):
                self._add(core, stream_id, request)
            case Abort(stream_id, request_ids, already_ended):
                ids = [r for r in request_ids if self._owner.get(r) == stream_id]
                if already_ended:
                    for rid in ids:
                        del self._owner[rid]
                core.abort_requests(ids)
                if core.kv_connector is not None:  # a finished prefill's kept K/V: no owner any more
                    core.kv_connector.release([r for r in request_ids if r not in self._owner])
            case CloseStream(stream_id):
                core.abort_requests([r for r, s in self._owner.items() if s == stream_id])
            case Drain(grace_s):
                if self.state is LoopState.SERVING:
                    self.state = LoopState.DRAINING
                    self._drain_deadline = time.monotonic() + grace_s
            case Stop():
                self.state = LoopState.STOPPED
            case Wake():
                pass  # the next has_work() sees the compiled grammar, the ended pull or lease
            case Call(fn, future):
                try:
                    future.set_result(fn(core))
                except Exception as exc:  # the caller's to report; the loop goes on
                    future.set_exception(exc)
            case _:
                raise UnknownMessageError(f"busy loop inbox: not a message: {message!r}")

    def _add(self, core: EngineCore, stream_id: int, request: EngineCoreRequest) -> None:
        rid = request.request_id
        error = None
        if self.state is not LoopState.SERVING:
            error = (ErrorCode.UNAVAILABLE, f"engine is {self.state.value}; send the request to another engine")
        elif rid in self._owner:
            error = (ErrorCode.INVALID_ARGUMENT, "duplicate request id: ids must be unique per engine")
        elif self._max_waiting is not None and self._queued_beyond_free_seats(core) >= self._max_waiting:
            error = (ErrorCode.RESOURCE_EXHAUSTED,
                     f"engine admission queue is full ({self._max_waiting} waiting); retry later")
        if error is not None:
            self._deliver(stream_id, EngineCoreOutputs(outputs=[_error_output(rid, *error)],
                                                       scheduler_stats=self.stats, timestamp=time.time()))
            return
        self._owner[rid] = stream_id
        core.add_request(request)

    @staticmethod
    def _queued_beyond_free_seats(core: EngineCore) -> int:
        """Waiting requests the next step cannot seat: a burst into free seats is not a queue."""
        sched = core.scheduler
        return sched.num_waiting - max(0, sched.max_num_seqs - sched.num_running)

    def _route(self, outputs: EngineCoreOutputs) -> None:
        if not outputs.outputs:
            return
        by_stream: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        owner = self._owner
        for out in outputs.outputs:
            sid = owner.get(out.request_id)
            if sid is None:
                continue  # its stream is gone
            if out.finish_reason:
                del owner[out.request_id]
            by_stream[sid].append(out)
        for sid, outs in by_stream.items():
            self._deliver(sid, EngineCoreOutputs(outputs=outs, scheduler_stats=outputs.scheduler_stats,
                                                 timestamp=outputs.timestamp))

    def _check_drain(self, core: EngineCore) -> None:
        """DRAINING -> DRAINED once nothing is in flight (reported once); at the deadline, fail the rest."""
        if not core.has_unfinished_requests():
            self.state = LoopState.DRAINED
            self._on_drained()
        elif time.monotonic() >= self._drain_deadline:
            self._fail_all("engine drained: the grace period ended before this request finished",
                           abort_in=core)

    def _fail_all(self, message: str, abort_in: EngineCore | None = None) -> None:
        """End every live request with UNAVAILABLE (so a client can retry elsewhere)."""
        by_stream: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        for rid, sid in self._owner.items():
            by_stream[sid].append(_error_output(rid, ErrorCode.UNAVAILABLE, message))
        ids = list(self._owner)
        self._owner.clear()
        if abort_in is not None:
            abort_in.abort_requests(ids)
            while abort_in.has_unfinished_requests():  # flush the aborts so every block is freed
                abort_in.step()
        for sid, outs in by_stream.items():
            self._deliver(sid, EngineCoreOutputs(outputs=outs, scheduler_stats=self.stats, timestamp=time.time()))
