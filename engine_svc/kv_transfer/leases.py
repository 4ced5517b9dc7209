"""The producer's leases: K/V blocks kept after a prefill for a consumer to pull.

A lease is made on the scheduler thread when a request that asked for it (`do_remote_decode`) finishes by
length; it holds the request's block table (the blocks stay allocated, ref-counted, out of the free
queue, so nothing overwrites them). It ends exactly once, in one of three ways: pulled (the pull stream
ended, however it ended: each lease is pulled at most once), released (the request's id was aborted),
or expired (`duration_s` passed with no pull begun; a pull in progress is never cut short). An ended
lease's request is handed back by `take_ended` on the scheduler thread, which frees its blocks.
`begin_pull` / `end_pull` run on the gRPC threads; every method takes the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_svc.request import Request


@dataclass
class Lease:
    request: Request
    block_ids: list[int]
    num_tokens: int  # tokens whose K/V the blocks hold
    expires_at: float  # time.monotonic()
    pulling: bool = False
    released: bool = False  # aborted while a pull was in progress: ends when the pull does


class LeaseTable:
    def __init__(self, duration_s: float, on_ended: Callable[[], None] = lambda: None) -> None:
        """`on_ended` is called (from any thread) when a lease ends off the scheduler thread: a wake-up."""
        self.duration_s = duration_s
        self.on_ended = on_ended
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._ended: list[Request] = []
        self.num_pulled = self.num_expired = self.num_released = 0  # cumulative

    def hold(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        with self._lock:
            self._leases[request.request_id] = Lease(request, block_ids, num_tokens,
                                                     time.monotonic() + self.duration_s)

    def begin_pull(self, request_id: str) -> Lease | None:
        """The lease, now marked as being pulled; None if there is none to pull (unknown, ended, or
        already being pulled)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.pulling or lease.expires_at <= time.monotonic():
                return None
            lease.pulling = True
            return lease

    def end_pull(self, request_id: str) -> None:
        """The pull stream ended: the lease ends (its blocks are freed by the next `take_ended`)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return
            self._ended.append(lease.request)
            self.num_pulled += 1
        self.on_ended()

    def release(self, request_id: str) -> bool:
        """Abort: end the lease now (or when its pull in progress ends). False if there is none."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            if lease.pulling:
                lease.released = True
                return True
            del self._leases[request_id]
            self._ended.append(lease.request)
            self.num_released += 1
            return True

    def take_ended(self) -> list[Request]:
        """Requests whose leases ended (pulled, released or expired now): the caller frees their blocks."""
        now = time.monotonic()
        with self._lock:
            for request_id in [r for r, lease in self._expired(now) if not lease.pulling]:
                self._ended.append(self._leases.pop(request_id).request)
                self.num_expired += 1
            ended, self._ended = self._ended, []
            return ended

    def _expired(self, now: float) -> list[tuple[str, Lease]]:
        """The leases past their end (held with the lock). Every lease lasts `duration_s` and the table keeps
        insertion order, so they are a prefix of it: the scan stops at the first lease still running."""
        expired = []
        for request_id, lease in self._leases.items():
            if lease.expires_at > now:
                break
            expired.append((request_id, lease))
        return expired

    def has_ended(self) -> bool:
        """Whether `take_ended` would return something now."""
        now = time.monotonic()
        with self._lock:
            return bool(self._ended) or any(not lease.pulling for _, lease in self._expired(now))

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def num_blocks_held(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())
