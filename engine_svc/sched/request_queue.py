"""Waiting queues: the order in which the scheduler admits requests.

- `fcfs`: arrival order; a preempted request goes back to the head (it is older than anything waiting).
- `priority`: lower `priority` value first, then earlier `arrival_time`, then order of first `add`. A
  preempted request goes back in under the same key, so it keeps its place in line.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from engine_svc.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None:
        """A new arrival."""

    def prepend(self, request: Request) -> None:
        """A preempted request, going back to its place in line."""

    def peek(self) -> Request:
        """The next request to admit. IndexError when empty."""

    def pop(self) -> Request:
        """Remove and return `peek()`."""

    def remove(self, request: Request) -> None:
        """Take a request out of the queue (abort). ValueError when absent."""

    def forget(self, request_id: str) -> None:
        """The request ended for good; drop any bookkeeping kept for it."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]:
        """Requests in admission order."""


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def forget(self, request_id: str) -> None:
        pass

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue:
    """A heap of (priority, arrival_time, seq, request); `seq` is fixed at first `add` and reused on
    `prepend`, so ties keep arrival order across preemptions."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq_of: dict[str, int] = {}
        self._next_seq = 0

    def add(self, request: Request) -> None:
        self._seq_of[request.request_id] = self._next_seq
        self._next_seq += 1
        self._push(request)

    def prepend(self, request: Request) -> None:
        if request.request_id not in self._seq_of:
            self.add(request)
        else:
            self._push(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        i = next((i for i, entry in enumerate(self._heap) if entry[3] is request), None)
        if i is None:
            raise ValueError(f"{request.request_id} is not waiting")
        self._heap[i] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def forget(self, request_id: str) -> None:
        self._seq_of.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def _push(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, self._seq_of[request.request_id], request)
        heapq.heappush(self._heap, key)


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected 'fcfs' or 'priority'")
