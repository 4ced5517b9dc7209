"""The `vllm.Inference` calls in flight, by request id: what `vllm.Control/Abort` ends.

Invariants:
- A call is findable by its request id from its admission until its end: by the client's id at once,
  by the id the frontend assigned (when the client sent none) once its prompt was prepared.
- Aborting a call that is still being tokenized marks it; it is aborted as soon as it has been sent to
  an engine (`InferenceServicer` checks the mark), so an abort is never lost to that window.
- Request ids may repeat across calls (as in vLLM): an abort ends every call in flight with that id.
"""

from __future__ import annotations

from collections.abc import Iterable

from frontend_svc.generation import Generation


class Entry:
    """One call: its generation, the id it is found by, whether an abort came."""

    __slots__ = ("aborted", "generation", "request_id")

    def __init__(self, generation: Generation, request_id: str | None) -> None:
        self.generation = generation
        self.request_id = request_id
        self.aborted = False


class InFlight:
    def __init__(self) -> None:
        self._by_id: dict[str, set[Entry]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_id.values())

    def add(self, request_id: str | None, generation: Generation) -> Entry:
        """A call admitted with the client's `request_id` (None: the frontend assigns one)."""
        entry = Entry(generation, request_id)
        if request_id is not None:
            self._by_id.setdefault(request_id, set()).add(entry)
        return entry

    def started(self, entry: Entry, request_id: str) -> None:
        """The call was sent to an engine as `request_id` (the assigned id, when the client gave none)."""
        if entry.request_id is None:
            entry.request_id = request_id
            self._by_id.setdefault(request_id, set()).add(entry)

    def remove(self, entry: Entry) -> None:
        """The call ended (idempotent)."""
        if entry.request_id is None:
            return
        entries = self._by_id.get(entry.request_id)
        if entries is not None:
            entries.discard(entry)
            if not entries:
                del self._by_id[entry.request_id]

    def abort(self, request_ids: Iterable[str]) -> int:
        """End every call in flight with one of `request_ids` (their unfinished sequences finish ABORTED);
        the number of calls found. Unknown ids are ignored, as vLLM ignores them."""
        found = 0
        for request_id in request_ids:
            for entry in list(self._by_id.get(request_id, ())):
                entry.aborted = True
                entry.generation.abort()
                found += 1
        return found
