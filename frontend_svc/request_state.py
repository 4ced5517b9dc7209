"""One client request in flight: the single owner of its progress, and where its output waits.

`RequestState` (made by `OutputProcessor.add_request`) holds the request's unfinished completions: a
completion leaves `unfinished` exactly once, when it finishes or is aborted, so `num_unfinished` and
`done` are derived from it (the engine client's per-engine load reads it; a `Generation` reading the
deltas ends when it has handed out one final delta per completion).

`DeltaCollector` is the request's outbox when a consumer (an API handler) reads it asynchronously. It
holds at most one pending delta per completion: a delta arriving while the previous one is unread is
merged into it (`CompletionDelta.merge`), so a slow reader costs memory bounded by the request's n, not
by how far it lags. A failure (`ServiceError`) is delivered after whatever deltas are already pending.
Everything here runs on one asyncio loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from frontend_svc.errors import ServiceError
from frontend_svc.outputs import CompletionDelta
from frontend_svc.processor import PreparedRequest

if TYPE_CHECKING:  # both import this module
    from frontend_svc.engine_client import EngineConnection
    from frontend_svc.output_processor import Completion


class DeltaCollector:
    """Deltas waiting for one reader, merged per completion index; then, possibly, one failure."""

    __slots__ = ("_failure", "_pending", "_ready")

    def __init__(self) -> None:
        self._pending: dict[int, CompletionDelta] = {}  # completion index -> unread (merged) delta
        self._failure: ServiceError | None = None
        self._ready = asyncio.Event()

    def put(self, delta: CompletionDelta) -> None:
        unread = self._pending.get(delta.index)
        if unread is None:
            self._pending[delta.index] = delta
        else:
            unread.merge(delta)
        self._ready.set()

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
        nothing is pending and the request failed, raise its `ServiceError`."""
        await self._ready.wait()
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
