"""Limits of an HTTP listener, and the connection cap that every HTTP listener of tandem applies.

- `HttpLimits`: header bytes and count, the keep-alive, header-read and body timeouts, the connection
  cap and the listen backlog (docs/security.md lists each with its default). `add_http_limit_args` adds
  their flags (vLLM's names where vLLM has one: `--h11-max-incomplete-event-size`,
  `--h11-max-header-count`); `http_limit_argv` gives them back as flags (`tandem serve` forwards them).
- `ConnectionGuard`: at most `limit` open connections on one listener. A new connection over the cap
  closes the *idle* connection that has waited longest (no request in progress: between keep-alive
  requests, still sending its first header, or in its TLS handshake - each has a timeout anyway), so
  idle sockets can never lock out a real client; only when every connection is busy with a request is
  the new one refused. Refusals and evictions are logged at most once per `log_every_s`, with counts.
- `RateLimitFilter`: a logging filter that lets a chosen message through at most once per interval
  (what an attacker can trigger per connection must not flood the log).
- `fd_budget(limit)`: the connection cap lowered to what this process's file-descriptor limit allows.

Standard library only, thread-safe (the metrics listener runs one thread per connection).
"""

from __future__ import annotations

import argparse
import logging
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Protocol

logger = logging.getLogger(__name__)

RESERVED_FDS = 512  # file descriptors kept for gRPC, engine links, files and threads beyond HTTP connections


@dataclass(frozen=True)
class HttpLimits:
    """Limits of one HTTP listener; the defaults are the API port's (docs/security.md)."""

    max_header_bytes: int = 64 * 1024  # request line + headers; more: 431
    max_header_count: int = 100  # header fields; more: 431
    keep_alive_timeout_s: float = 5.0  # an open connection with no request and no bytes is closed after this
    header_timeout_s: float = 10.0  # from a request's first byte (or the TLS handshake) to its last header byte
    body_timeout_s: float = 30.0  # from the end of the headers to the end of the body; then 408
    max_connections: int = 2048  # open connections on the listener (idle ones are closed first)
    backlog: int = 128  # the kernel's queue of connections not yet accepted

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_header_count", "max_connections", "backlog"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_FLAGS[name]} must be >= 1, got {getattr(self, name)}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"--{_FLAGS['max_header_bytes']} must be >= 1024, got {self.max_header_bytes}")
        for name in ("keep_alive_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"--{_FLAGS[name]} must be in (0, 3600] seconds, got {getattr(self, name)}")


_FLAGS = {
    "max_header_bytes": "h11-max-incomplete-event-size",
    "max_header_count": "h11-max-header-count",
    "keep_alive_timeout_s": "http-timeout-keep-alive",
    "header_timeout_s": "http-header-timeout",
    "body_timeout_s": "http-body-timeout",
    "max_connections": "http-max-connections",
    "backlog": "http-backlog",
}
_HELP = {
    "max_header_bytes": "largest HTTP request line + header block in bytes (more: 431)",
    "max_header_count": "most HTTP header fields in a request (more: 431)",
    "keep_alive_timeout_s": "seconds an HTTP connection may sit idle (no request) before it is closed",
    "header_timeout_s": "seconds a request's header (or a TLS handshake) may take to arrive",
    "body_timeout_s": "seconds a request's body may take to arrive after its header (then 408)",
    "max_connections": "open HTTP connections; past it the longest-idle one is closed, or the new one "
                       "refused with 503 when none is idle",
    "backlog": "listen backlog of the HTTP port",
}


def add_http_limit_args(group: argparse._ArgumentGroup) -> None:
    """The HTTP listener's limit flags (defaults: `HttpLimits`)."""
    defaults = HttpLimits()
    for f in fields(HttpLimits):
        default = getattr(defaults, f.name)
        group.add_argument(f"--{_FLAGS[f.name]}", dest=f"http_{f.name}", type=type(default), default=default,
                           help=f"{_HELP[f.name]} (default {default})")


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """Raises ValueError naming the flag of a bad value."""
    return HttpLimits(**{f.name: getattr(args, f"http_{f.name}") for f in fields(HttpLimits)})


def http_limit_argv(args: argparse.Namespace) -> list[str]:
    """The flags of the limits that differ from the defaults (to forward them to a child process)."""
    defaults = HttpLimits()
    out: list[str] = []
    for f in fields(HttpLimits):
        value = getattr(args, f"http_{f.name}")
        if value != getattr(defaults, f.name):
            out += [f"--{_FLAGS[f.name]}", str(value)]
    return out


def fd_budget(limit: int) -> int:
    """`limit`, lowered (with a warning) so that HTTP connections leave `RESERVED_FDS` descriptors free."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or limit + RESERVED_FDS <= soft:
        return limit
    budget = max(16, soft - RESERVED_FDS)
    logger.warning("the file-descriptor limit (%d) leaves room for %d HTTP connections, fewer than the %d "
                   "asked for: raise `ulimit -n`", soft, budget, limit)
    return budget


def raise_fd_limit(wanted: int = 65536) -> None:
    """Raise this process's soft file-descriptor limit towards `wanted` (never above the hard limit), as
    servers do at start (vLLM's `set_ulimit`): the default soft limit of 1024 is soon spent on sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the file-descriptor limit from %d to %d: %s", soft, target, exc)


class Connection(Protocol):
    def evict(self) -> None:
        """Close this idle connection to make room for a new one."""


class ConnectionGuard:
    """The cap on one listener's open connections (see the module docstring).

    Protocol: `admit(conn)` when a connection is accepted (False: refuse it - close it at once);
    `busy(conn)` when a request's header has arrived; `idle(conn)` when its response is complete;
    `release(conn)` when it closes (exactly once per admitted connection). A new connection is idle.
    """

    def __init__(self, limit: int, what: str, log_every_s: float = 10.0) -> None:
        self.limit = limit
        self.what = what
        self.open = 0
        self.refused = 0  # cumulative
        self.evicted = 0  # cumulative
        self._idle: OrderedDict[Connection, None] = OrderedDict()  # longest idle first
        self._lock = threading.Lock()
        self._log_every_s = log_every_s
        self._next_log = 0.0
        self._unlogged = (0, 0)  # (refused, evicted) since the last log line

    def admit(self, conn: Connection) -> bool:
        victim = None
        with self._lock:
            if self.open >= self.limit:
                if not self._idle:
                    self.refused += 1
                    self._note(refused=1)
                    return False
                victim, _ = self._idle.popitem(last=False)
                self.evicted += 1
                self._note(evicted=1)
            self.open += 1
            self._idle[conn] = None
        if victim is not None:
            victim.evict()  # it stays counted until it calls release()
        return True

    def busy(self, conn: Connection) -> None:
        with self._lock:
            self._idle.pop(conn, None)

    def idle(self, conn: Connection) -> None:
        with self._lock:
            self._idle[conn] = None
            self._idle.move_to_end(conn)

    def release(self, conn: Connection) -> None:
        with self._lock:
            self._idle.pop(conn, None)
            self.open -= 1

    def _note(self, refused: int = 0, evicted: int = 0) -> None:
        """Count a refusal / eviction; log the counts at most once per interval (lock held)."""
        r, e = self._unlogged
        self._unlogged = (r + refused, e + evicted)
        now = time.monotonic()
        if now >= self._next_log:
            r, e = self._unlogged
            logger.warning("%s: %d connections open (the cap): %d new connection(s) refused and %d idle "
                           "one(s) closed to make room since the last report", self.what, self.open, r, e)
            self._next_log = now + self._log_every_s
            self._unlogged = (0, 0)


class RateLimitFilter(logging.Filter):
    """Let each of `messages` (a record's unformatted msg, or its prefix) through at most once per
    `interval_s`; the next one that passes says how many were dropped."""

    def __init__(self, messages: Iterable[str], interval_s: float = 10.0) -> None:
        super().__init__()
        self.messages = tuple(messages)
        self.interval_s = interval_s
        self._next: dict[str, float] = {}
        self._dropped: dict[str, int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        key = next((m for m in self.messages if text.startswith(m)), None)
        if key is None:
            return True
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(key, 0.0):
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return False
            self._next[key] = now + self.interval_s
            dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{text} ({dropped} more like it in the last {self.interval_s:.0f} s not logged)"
        return True


def rate_limit_logs(logger_name: str, messages: Iterable[str], interval_s: float = 10.0) -> None:
    """Install a `RateLimitFilter` for `messages` on a logger (once per logger)."""
    target = logging.getLogger(logger_name)
    if not any(isinstance(f, RateLimitFilter) for f in target.filters):
        target.addFilter(RateLimitFilter(messages, interval_s))
