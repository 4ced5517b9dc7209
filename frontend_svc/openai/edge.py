"""The HTTP edge of the OpenAI API: uvicorn's h11 protocol with the limits uvicorn lacks (docs/security.md).

uvicorn gives the header-size limit (`h11_max_incomplete_event_size`: h11 stops buffering a header block
past it) and the idle keep-alive timeout after a response. `GuardedH11Protocol` adds, per connection:

- TCP_NODELAY on the accepted socket (asyncio sets it only for sockets created with IPPROTO_TCP; without
  it every keep-alive response waits for Nagle's algorithm and the peer's delayed ACK).
- the connection cap (`ConnectionGuard`), applied at accept, *before* a TLS handshake: TLS is started
  here (`loop.start_tls`, bounded by the header timeout) rather than by asyncio's server, so a flood of
  handshakes cannot hold descriptors past the cap or past the timeout.
- an idle timeout for a fresh connection too (uvicorn arms it only after a first response), a header-read
  timeout from a request's first byte to its last header byte (slowloris), and a body timeout from the
  end of the headers to the end of the body (408).
- 431 (not uvicorn's 400) for a header block over the byte limit or with more than `max_header_count`
  fields, from h11's own error hint; the header is never parsed past the limit.

Streamed bodies (SSE) skip the per-chunk ASGI `send` chain: every request's scope carries a `RawBody`
(raw_body.py) that writes chunk-framed bytes straight to the transport, with uvicorn's flow control.

The HTTP parsing itself stays h11's. Invariants: every admitted connection is released from the guard
exactly once (when it closes, or when its handshake fails); a connection holds no timer after it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import socket
import ssl
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from frontend_svc.openai.raw_body import WithRawBody
from shared_runtime.security.http_limits import ConnectionGuard, HttpLimits

_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\nretry-after: 1\r\ncontent-length: 28\r\n\r\ntoo many connections; retry\n")


class EdgeConfig(uvicorn.Config):
    """uvicorn's Config plus what `GuardedH11Protocol` needs: the limits, the listener's guard, TLS."""

    def __init__(self, app: Any, *, limits: HttpLimits, guard: ConnectionGuard,
                 tls_context: ssl.SSLContext | None, **kwargs: Any) -> None:
        super().__init__(app, http=GuardedH11Protocol, h11_max_incomplete_event_size=limits.max_header_bytes,
                         timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
                         backlog=limits.backlog, **kwargs)
        self.limits = limits
        self.guard = guard
        self.tls_context = tls_context


class LimitedH11Connection(h11.Connection):
    """h11's server side, refusing more than `max_headers` header fields or `max_header_bytes` of request
    line + headers (431), remembering the status hint of the last protocol error, and reporting request
    boundaries to its protocol.

    h11 itself stops buffering an *incomplete* header block past `max_header_bytes`; a block that arrives
    complete in one read (up to 256 KiB) is parsed first and measured here."""

    def __init__(self, limits: HttpLimits, on_request: Callable[[], None], on_body_end: Callable[[], None]) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.max_headers = limits.max_header_count
        self.max_header_bytes = limits.max_header_bytes
        self.error_status = 400
        self._on_request = on_request
        self._on_body_end = on_body_end

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.error_status = exc.error_status_hint
            raise
        if type(event) is h11.Request:
            self._check_size(event)
            self._on_request()
        elif type(event) is h11.EndOfMessage:
            self._on_body_end()
        return event

    def _check_size(self, request: h11.Request) -> None:
        problem = None
        if len(request.headers) > self.max_headers:
            problem = f"more than {self.max_headers} header fields"
        elif len(request.target) + sum(len(k) + len(v) + 4 for k, v in request.headers) > self.max_header_bytes:
            problem = f"request line and headers over {self.max_header_bytes} bytes"
        if problem is not None:
            self.error_status = 431
            raise h11.RemoteProtocolError(problem, error_status_hint=431)


class GuardedH11Protocol(H11Protocol):
    """One HTTP connection: uvicorn's h11 protocol inside the limits of `EdgeConfig` (module docstring)."""

    conn: LimitedH11Connection
    raw_body = True  # offer streamed responses a `RawBody` (raw_body.py); False: every chunk through `send`

    def __init__(self, config: EdgeConfig, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        if self.raw_body:
            self.app = WithRawBody(self.app)
        self.limits = config.limits
        self.guard = config.guard
        self.tls_context = config.tls_context
        self.conn = LimitedH11Connection(config.limits, self._request_started, self._body_ended)
        self._raw: asyncio.Transport | None = None  # the TCP transport (under TLS, below self.transport)
        self._started = False  # uvicorn's connection_made has run (after the TLS handshake, if any)
        self._admitted = False
        self._early: list[bytes] = []  # application data that arrived with the end of the handshake
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._in_request = False

    # ---- accept, TLS, close --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw: asyncio.Transport = transport  # type: ignore[assignment]
        self._raw = raw
        sock = raw.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.guard.admit(self):
            if self.tls_context is None:
                raw.write(_REFUSED)
            raw.close()
            return
        self._admitted = True
        if self.tls_context is None:
            self._start(raw)
            return
        raw.pause_reading()  # nothing may reach this protocol before start_tls has taken the transport
        task = self.loop.create_task(self._handshake(raw, self.tls_context))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _handshake(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        try:
            tls = await self.loop.start_tls(raw, self, context, server_side=True,
                                            ssl_handshake_timeout=self.limits.header_timeout_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, asyncio.CancelledError, RuntimeError):
            raw.abort()
            self._release()
            return
        if tls is None:  # the transport closed during the handshake
            self._release()
        elif self._admitted:  # else it closed right after the handshake (connection_lost released it)
            self._start(tls)

    def _start(self, transport: asyncio.Transport) -> None:
        """Hand the connection (TLS already on, if any) to uvicorn; a fresh connection gets the idle
        timeout at once."""
        self._started = True
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def evict(self) -> None:
        """The guard needs this idle connection's slot."""
        if self._started:
            self.timeout_keep_alive_handler()
        elif self._raw is not None:
            self._raw.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._started:
            super().connection_lost(exc)
        self._release()

    def _release(self) -> None:
        if self._admitted:
            self._admitted = False
            self.guard.release(self)

    # ---- requests and their timeouts -----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if not self._started:
            self._early.append(data)
            return
        if not self._in_request and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)
        super().data_received(data)

    def _request_started(self) -> None:
        """h11 has a request's whole header: it is no longer idle; its body has its own deadline."""
        self._in_request = True
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.guard.busy(self)
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _body_ended(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_response_complete(self) -> None:
        self._in_request = False
        self._body_ended()
        if not self.transport.is_closing():
            self.guard.idle(self)
        super().on_response_complete()

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self._in_request:
            self.transport.close()

    def _body_timed_out(self) -> None:
        """The body did not arrive in time: 408 if no response has started, and close either way (the
        application then reads a disconnect)."""
        self._body_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
            if not cycle.response_started:
                self._send_error(408, "the request body did not arrive in time")
        self.transport.close()

    def send_400_response(self, msg: str) -> None:  # uvicorn calls it for any h11 protocol error
        self._send_error(self.conn.error_status, msg)

    def _send_error(self, status: int, msg: str) -> None:
        with contextlib.suppress(h11.LocalProtocolError):
            headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
            reason = http.HTTPStatus(status).phrase.encode()
            for event in (h11.Response(status_code=status, headers=headers, reason=reason),
                          h11.Data(data=msg.encode("ascii", "replace")), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        self.transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None
