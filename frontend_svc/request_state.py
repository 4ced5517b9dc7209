"""One client request in flight: the single owner of its progress, and where its output waits.

`RequestState` (made by `OutputProcessor.add_request`) holds the request's unfinished completions: a
completion leaves `unfinished` exactly once, when it finishes or is aborted, so `num_unfinished` and
`done` are derived from it (the engine client's per-engine load reads it; a `Generation` reading the
deltas ends when it has handed out one final delta per completion).

`DeltaCollector` is the request's outbox when a consumer (an API handler) reads it asynchronously. It
holds at most one pending delta per completion: a delta arriving while the previous one is unread is
merged into it (`CompletionDelta.merge`), so a slow reader costs memory bounded by the request's n, not
by how far it lags. A failure (`ServiceError`) is delivered after whatever deltas are already pending.
An unread delta may carry token ids whose text is not decoded yet (`defer`): the reader's `get` has
their completion decode them (`Completion.settle`) before handing it out, so the steps that come while a
reader is behind cost one tokenizer call per delta it takes, not one per step.

`DrainGate` paces an engine stream by its readers, as Nagle's algorithm paces a socket by its
acknowledgements: after processing a batch of engine messages the connection waits until the readers
it handed output to have taken it and sent it (at most `DRAIN_WAIT_S`) before it takes the next batch.
While the frontend keeps up, the readers are done long before the engine's next step arrives and nothing
waits; once it falls behind, the steps that queue meanwhile are processed together, so each stream
gets one response per several steps instead of one per step, and the per-response cost (a gRPC message
is ~30 us of frontend CPU, its tokens ~15 us) is spread over more tokens. A reader that does not drain
(a stalled client) holds back one batch by at most `DRAIN_WAIT_S`, once: the gate counts only the
readers handed output since its previous batch.

Everything here runs on one asyncio loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from frontend_svc.errors import ServiceError
from frontend_svc.outputs import CompletionDelta
from frontend_svc.processor import PreparedRequest

DRAIN_WAIT_S = 0.005  # the longest an engine batch waits for the previous batch's readers (DrainGate)

if TYPE_CHECKING:  # both import this module
    from frontend_svc.engine_client import EngineConnection
    from frontend_svc.output_processor import Completion


class DrainGate:
    """One engine stream's pacing by its readers (see the module docstring).

    Invariant: `_outstanding` counts the collectors handed output in the current epoch that have not
    yet come back for more; an epoch ends at each `drained()`, and a collector handed output in an earlier
    epoch no longer counts (its `taken` is ignored)."""

    __slots__ = ("_drained", "_epoch", "_outstanding")

    def __init__(self) -> None:
        self._epoch = 0
        self._outstanding = 0
        self._drained = asyncio.Event()

    @property
    def outstanding(self) -> int:
        """Readers handed output in this epoch that have not come back for more."""
        return self._outstanding

    def handed(self) -> int:
        """A collector with no unread output got some: the epoch to hand back to `taken`."""
        self._outstanding += 1
        return self._epoch

    def taken(self, epoch: int) -> None:
        """The reader of a collector handed output in `epoch` has taken and sent it."""
        if epoch == self._epoch:
            self._outstanding -= 1
            if not self._outstanding:
                self._drained.set()

    async def drained(self, timeout: float = DRAIN_WAIT_S) -> None:
        """Wait until the readers handed output in this epoch have taken it (at most `timeout`), then
        begin the next epoch."""
        if self._outstanding:
            self._drained.clear()
            expiry = asyncio.get_running_loop().call_later(timeout, self._drained.set)
            await self._drained.wait()
            expiry.cancel()
        self._epoch += 1
        self._outstanding = 0


class DeltaCollector:
    """Deltas waiting for one reader, merged per completion index; then, possibly, one failure.

    With a `gate` (set by the engine client when the request is sent), output put into an empty
    collector counts as handed to the reader until it comes back for more (`get`) or stops reading
    (`release`)."""

    __slots__ = ("_failure", "_handed", "_pending", "_ready", "_unsettled", "gate")

    def __init__(self) -> None:
        self._pending: dict[int, CompletionDelta] = {}  # completion index -> unread (merged) delta
        self._failure: ServiceError | None = None
        self._ready = asyncio.Event()
        self.gate: DrainGate | None = None
        self._handed = -1  # the gate's epoch when output was handed and not yet taken (-1: none)
        self._unsettled: list[Completion] = []  # owners of unread deltas whose text is still to be decoded

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

    def defer(self, owner: Completion) -> None:
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


class RequestState:
    """A submitted request: its prepared input, its unfinished completions, its outbox and engine."""

    __slots__ = ("collector", "connection", "prepared", "unfinished")

    def __init__(self, prepared: PreparedRequest, collector: DeltaCollector | None = None) -> None:
        self.prepared = prepared
        self.collector = collector  # None: deltas are returned by process_outputs (the offline API)
        self.unfinished: dict[str, Completion] = {}  # engine request id -> its running completion
        self.connection: EngineConnection | None = None  # the engine it was sent on (set by the engine client)

    @property
    def num_unfinished(self) -> int:
        return len(self.unfinished)

    @property
    def done(self) -> bool:
        return not self.unfinished

    def fail(self, error: ServiceError) -> None:
        """End the request with `error` for its reader (a request without a collector has none)."""
        if self.collector is not None:
            self.collector.fail(error)
