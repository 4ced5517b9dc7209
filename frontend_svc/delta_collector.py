"""`DeltaCollector`: where one request's output waits for its reader (an API handler).

It holds at most one pending delta per completion: a delta arriving while the previous one is unread is
merged into it (`CompletionDelta.merge`), so a slow reader costs memory bounded by the request's n, not
by how far it lags. A failure (`ServiceError`) is delivered after whatever deltas are already pending.

An unread delta may carry token ids whose text is not decoded yet: the output processor defers their
decode while the reader is behind (output_processor.py, "Where text is decoded"), and the reader's `get`
has their owner `settle()` them before handing the delta out. The collector never decodes anything itself.

With a `DrainGate` (engines/drain_gate.py) the collector tells the engine stream that fed it when its reader came
back for more. Everything here runs on one asyncio loop.

A `sink` (set by the reader's owner, `Generation.write_directly`) lets the task that processes engine
output hand deltas straight to the wire, without waking the reader's task: while the reader is *parked* in
`get` (it has sent everything it took, the request has not failed), a delta that neither finishes nor fails
waits, merged per completion as for any reader, until the engine batch being processed ends; then its
`SinkBatch` (the dispatcher's) `flush`es every collector it holds, and each pending delta is offered to the
sink, which writes it and accepts it, or refuses it (a connection over its high-water mark or gone): what
it refused wakes the reader as usual. A finish or a failure always wakes the reader (with whatever is
pending, merged). So a stream gets one write per engine batch, as a reader woken per batch would send, the
reader sees every delta the sink did not take, in order after those it took, and a slow reader still gets
merged deltas (nothing is offered to the sink until it parks again). An exception from the sink turns it
off and is raised by the reader's next `get`. A collector without a batch never uses its sink.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from frontend_svc.engines.drain_gate import DrainGate
from frontend_svc.outputs import CompletionDelta
from frontend_svc.service_error import ServiceError


class Settles(Protocol):
    """The owner of an unread delta whose text is still to be decoded (`output_processor.Completion`)."""

    def settle(self) -> None:
        """Give the unread delta the text of its undecoded ids."""


Sink = Callable[[CompletionDelta], bool]  # True: the delta was written (see the module docstring)


class SinkBatch:
    """The collectors whose parked readers' sinks have deltas waiting for the end of the engine batch
    being processed (`DeltaCollector.put`); the processing `flush`es it when the batch (a slice) ends."""

    __slots__ = ("_collectors",)

    def __init__(self) -> None:
        self._collectors: list[DeltaCollector] = []

    def add(self, collector: DeltaCollector) -> None:
        self._collectors.append(collector)

    def flush(self) -> None:
        collectors, self._collectors = self._collectors, []
        for collector in collectors:
            collector.flush()


class DeltaCollector:
    """Deltas waiting for one reader, merged per completion index; then, possibly, one failure.

    With a `gate` (set by the dispatcher when the request is sent), output put into an empty
    collector counts as handed to the reader until it comes back for more (`get`) or stops reading
    (`release`)."""

    __slots__ = ("_failure", "_handed", "_parked", "_pending", "_queued", "_ready", "_sink_error", "_unsettled",
                 "batch", "gate", "sink")

    def __init__(self) -> None:
        self._pending: dict[int, CompletionDelta] = {}  # completion index -> unread (merged) delta
        self._failure: ServiceError | None = None
        self._ready = asyncio.Event()
        self.gate: DrainGate | None = None
        self._handed = -1  # the gate's epoch when output was handed and not yet taken (-1: none)
        self._unsettled: list[Settles] = []  # owners of unread deltas whose text is still to be decoded
        self.sink: Sink | None = None
        self.batch: SinkBatch | None = None  # set by the dispatcher, which flushes it after each batch
        self._parked = False  # the reader waits in `get` (it sent what it took): the sink may take deltas
        self._queued = False  # in `batch`, to be flushed
        self._sink_error: Exception | None = None

    def put(self, delta: CompletionDelta) -> CompletionDelta:
        """Add `delta` for the reader (or, parked, for the sink at the batch's end); return the unread delta
        of its index it is now part of."""
        unread = self._pending.get(delta.index)
        if unread is None:
            self._pending[delta.index] = unread = delta
        else:
            unread.merge(delta)
        if self._parked and delta.finish_reason is None and self.sink is not None and self.batch is not None:
            if not self._queued:
                self._queued = True
                self.batch.add(self)
            return unread
        self._wake()
        return unread

    def flush(self) -> None:
        """The batch ended: offer the pending deltas to the sink (while the reader is still parked); wake
        the reader for whatever it refused."""
        self._queued = False
        if not self._parked or not self._pending:
            return  # the reader was woken meanwhile: it takes them
        sink = self.sink
        if sink is not None:
            try:
                self._settle()
                for index, delta in list(self._pending.items()):
                    if not sink(delta):
                        break
                    del self._pending[index]
            except Exception as exc:  # the reader raises it (what is pending waits for it, unwritten)
                self.sink = None
                self._sink_error = exc
        if self._pending or self._sink_error is not None:
            self._wake()

    def _wake(self) -> None:
        self._parked = False
        if self._handed < 0 and self.gate is not None:
            self._handed = self.gate.handed()
        self._ready.set()

    def _settle(self) -> None:
        if self._unsettled:
            for owner in self._unsettled:
                owner.settle()
            self._unsettled.clear()

    def unread(self, index: int) -> CompletionDelta | None:
        """The delta of completion `index` waiting for the reader, if any."""
        return self._pending.get(index)

    def defer(self, owner: Settles) -> None:
        """`owner`'s unread delta has ids whose text `owner.settle()` adds before the reader takes it."""
        self._unsettled.append(owner)

    def release(self) -> None:
        """The reader is done with what it took (it sent it, or it stops reading)."""
        if self._handed >= 0 and self.gate is not None:  # only a gated collector is ever handed output
            self.gate.taken(self._handed)
            self._handed = -1

    def fail(self, error: ServiceError) -> None:
        """End the request with `error` (the first failure wins)."""
        if self._failure is None:
            self._failure = error
        self._parked = False
        self._ready.set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def get(self) -> list[CompletionDelta]:
        """Wait for output: every pending delta (one per completion index, in arrival order); once
        nothing is pending and the request failed, raise its `ServiceError`. Calling it again means the
        previous output was sent (`release`)."""
        self.release()
        if not self._ready.is_set():
            self._parked = self.sink is not None and self._failure is None and not self._pending
            try:
                await self._ready.wait()
            finally:
                self._parked = False
        if self._sink_error is not None:
            error, self._sink_error = self._sink_error, None
            try:
                raise error
            finally:
                del error  # no cycle through this frame
        self._settle()
        if self._pending:
            deltas = list(self._pending.values())
            self._pending.clear()
        elif self._failure is not None:
            raise self._failure
        else:  # pragma: no cover - the event is only set with something to read
            deltas = []
        if self._failure is None:
            self._ready.clear()
        return deltas
