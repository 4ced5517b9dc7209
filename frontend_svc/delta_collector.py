"""`DeltaCollector`: where one request's output waits for its reader (an API handler).

It holds at most one pending delta per completion: a delta arriving while the previous one is unread is
merged into it (`CompletionDelta.merge`), so a slow reader costs memory bounded by the request's n, not
by how far it lags. A failure (`ServiceError`) is delivered after whatever deltas are already pending.

An unread delta may carry token ids whose text is not decoded yet: the output processor defers their
decode while the reader is behind (output_processor.py, "Where text is decoded"), and the reader's `get`
has their owner `settle()` them before handing the delta out. The collector never decodes anything itself.

With a `DrainGate` (engines/drain_gate.py) the collector tells the engine stream that fed it when its reader came
back for more. Everything here runs on one asyncio loop.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from frontend_svc.engines.drain_gate import DrainGate
from frontend_svc.outputs import CompletionDelta
from frontend_svc.service_error import ServiceError


class Settles(Protocol):
    """The owner of an unread delta whose text is still to be decoded (`output_processor.Completion`)."""

    def settle(self) -> None:
        """Give the unread delta the text of its undecoded ids."""


class DeltaCollector:
    """Deltas waiting for one reader, merged per completion index; then, possibly, one failure.

    With a `gate` (set by the dispatcher when the request is sent), output put into an empty
    collector counts as handed to the reader until it comes back for more (`get`) or stops reading
    (`release`)."""

    __slots__ = ("_failure", "_handed", "_pending", "_ready", "_unsettled", "gate")

    def __init__(self) -> None:
        self._pending: dict[int, CompletionDelta] = {}  # completion index -> unread (merged) delta
        self._failure: ServiceError | None = None
        self._ready = asyncio.Event()
        self.gate: DrainGate | None = None
        self._handed = -1  # the gate's epoch when output was handed and not yet taken (-1: none)
        self._unsettled: list[Settles] = []  # owners of unread deltas whose text is still to be decoded

    def put(self, delta: CompletionDelta) -> CompletionDelta:
        """Add `delta` for the reader; return the unread delta of its index it is now part of."""
        unread = self._pending.get(delta.index)
        if unread is None:
            self._pending[delta.index] = unread = delta
        else:
            unread.merge(delta)
        if self._handed < 0 and self.gate is not None:
            self._handed = self.gate.handed()
        self._ready.set()
        return unread

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
        self._ready.set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def get(self) -> list[CompletionDelta]:
        """Wait for output: every pending delta (one per completion index, in arrival order); once
        nothing is pending and the request failed, raise its `ServiceError`. Calling it again means the
        previous output was sent (`release`)."""
        self.release()
        await self._ready.wait()
        if self._unsettled:
            for owner in self._unsettled:
                owner.settle()
            self._unsettled.clear()
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
