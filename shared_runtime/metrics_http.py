"""Prometheus `/metrics` over HTTP, with the limits of every tandem HTTP listener (docs/security.md).

prometheus_client's own server runs one thread per connection with no timeout and no cap: idle or
half-sent connections held a thread and a descriptor each, forever. `MetricsServer` is the same WSGI
app (`make_wsgi_app`) on the standard library's threaded server, plus:

- a connection cap (`ConnectionGuard`: the longest-idle connection - one that has not sent its request
  line and headers yet - is closed for a newcomer; when all are busy the newcomer is closed at once);
- a deadline per connection (`header_timeout_s` per socket operation, and the whole request and
  response within `header_timeout_s + body_timeout_s` of the accept, enforced by one reaper thread);
- at most `max_header_bytes` of request line + headers (431) and the standard library's 100 header
  fields (431); TCP_NODELAY on every accepted socket; a small listen backlog.

It serves on a daemon thread, off the services' event loops, so a scrape never stalls a stream.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app

from shared_runtime.security.http_limits import ConnectionGuard, HttpLimits

logger = logging.getLogger(__name__)

METRICS_LIMITS = HttpLimits(max_header_bytes=16 * 1024, max_header_count=100, keep_alive_timeout_s=5.0,
                            header_timeout_s=5.0, body_timeout_s=5.0, max_connections=64, backlog=16)
_REAP_EVERY_S = 0.5


class _Slot:
    """One accepted connection, as the guard and the reaper see it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def evict(self) -> None:
        """Wake the handler blocked on this socket: its next read or write fails and it ends."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class _HeaderBudget:
    """The request's byte budget for request line + headers over a buffered reader (431 past it)."""

    def __init__(self, inner: Any, budget: int) -> None:
        self._inner = inner
        self._left = budget

    def readline(self, size: int = -1) -> bytes:
        limit = self._left + 1 if size < 0 else min(size, self._left + 1)
        line: bytes = self._inner.readline(limit)
        self._left -= len(line)
        if self._left < 0:
            raise http.client.LineTooLong("request line and headers")  # parse_request answers 431
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Handler(WSGIRequestHandler):
    server: MetricsServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.limits.header_timeout_s)  # per socket operation
        self.rfile = _HeaderBudget(self.rfile, self.server.limits.max_header_bytes)  # type: ignore[assignment]

    def parse_request(self) -> bool:
        ok = super().parse_request()
        slot = self.server.slot_of(self.request)
        if ok and slot is not None:
            self.server.guard.busy(slot)
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        """No access log (as prometheus_client's own handler)."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """`registry` at http://host:port/metrics; `start()` serves on a daemon thread."""

    daemon_threads = True

    def __init__(self, host: str, port: int, registry: Any, limits: HttpLimits = METRICS_LIMITS) -> None:
        self.limits = limits
        self.request_queue_size = limits.backlog
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.guard = ConnectionGuard(limits.max_connections, f"metrics port {port}")
        self._slots: dict[socket.socket, _Slot] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        super().__init__((host, port), _Handler)
        self.set_app(make_wsgi_app(registry))

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, name="metrics-http", daemon=True).start()
        threading.Thread(target=self._reap, name="metrics-http-reaper", daemon=True).start()

    def slot_of(self, sock: socket.socket) -> _Slot | None:
        with self._lock:
            return self._slots.get(sock)

    def process_request(self, request: Any, client_address: Any) -> None:
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        slot = _Slot(request, time.monotonic() + self.limits.header_timeout_s + self.limits.body_timeout_s)
        if not self.guard.admit(slot):
            super().shutdown_request(request)
            return
        with self._lock:
            self._slots[request] = slot
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            slot = self._slots.pop(request, None)
        if slot is not None:
            self.guard.release(slot)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that broke off (timeout, reset, a request line past the budget): nothing to log."""

    def _reap(self) -> None:
        while not self._stopped.wait(_REAP_EVERY_S):
            now = time.monotonic()
            with self._lock:
                late = [slot for slot in self._slots.values() if slot.deadline <= now]
            for slot in late:
                slot.evict()

    def server_close(self) -> None:
        self._stopped.set()
        super().server_close()


def start_metrics_server(host: str, port: int, registry: Any,
                         limits: HttpLimits = METRICS_LIMITS) -> MetricsServer:
    """A started `MetricsServer`; raises OSError when the port cannot be bound."""
    server = MetricsServer(host, port, registry, limits)
    server.start()
    return server

