"""A streamed response body written straight to its connection, below Starlette and uvicorn's `send`.

A streaming response that sends each SSE event through ASGI's `send` pays, per event, Starlette's send
wrappers (the error middleware, the exception handler), uvicorn's `RequestResponseCycle.send` and h11's
state machine before the bytes reach the transport. `RawBody` is what the HTTP edge (edge.py) offers a
response instead, in `scope["extensions"][RAW_BODY]`: after the response has *started* through `send`
(status line and headers still go through uvicorn and h11), `write(data)` frames `data` exactly as h11
would (HTTP/1.1 chunked encoding: `<hex length>\\r\\n<data>\\r\\n`; any other framing h11 chose is left
to h11) and writes it to the transport. The end of the body (`more_body: False`) goes through `send`
again, so h11 writes the last chunk and uvicorn completes the cycle (keep-alive, the edge's accounting).

Invariants:
- The bytes on the wire are the bytes `send` would have written for the same body chunks: h11's chunked
  writer keeps no state between chunks, and an empty chunk writes nothing (as h11: a 0-length chunk would
  end the body).
- Backpressure is kept: when the transport's buffer is over its high-water mark (uvicorn's `FlowControl`
  sees `pause_writing`), `write` returns only once it has drained, so a reader that does not read holds
  at most the high-water mark plus one chunk in the frontend; the generation behind it merges its deltas
  meanwhile (frontend_svc/delta_collector.py).
- `write_now` is `write` for a caller that is not a task of its own (the engine step's processing, through
  the generation's sink, delta_collector.py): it writes only while `writable` (under the high-water mark),
  and otherwise leaves the chunk to the response's task, whose `write` waits.
- Nothing is written once the client is gone (`write` returns False); the disconnect itself is noticed
  by the response's own watch on `receive` (sse.EventStream), as with Starlette.
"""

from __future__ import annotations

from typing import Any, Protocol

import h11
from h11._writers import ChunkedWriter
from starlette.types import ASGIApp, Receive, Scope, Send

RAW_BODY = "tandem.raw_body"  # the scope extension's key


class _Flow(Protocol):
    write_paused: bool

    async def drain(self) -> None: ...


class RawBody:
    """The body of one request's response (one uvicorn h11 `RequestResponseCycle`); `start()` once the
    response has started, then `write()` per chunk."""

    __slots__ = ("_chunked", "_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow: _Flow = cycle.flow
        self._chunked = False

    def start(self) -> None:
        """Called after `http.response.start` went through `send`: picks the framing h11 chose for it."""
        if not self._cycle.response_started:
            raise RuntimeError("RawBody.start() before the response started")
        self._chunked = type(getattr(self._cycle.conn, "_writer", None)) is ChunkedWriter

    async def write(self, data: bytes) -> bool:
        """Write `data` as the next part of the body; False (nothing written) once the client is gone."""
        if self._cycle.disconnected:
            return False
        self.write_now(data)
        if self._flow.write_paused:
            await self._flow.drain()  # uvicorn's connection_lost resumes it too, so this always returns
        return not self._cycle.disconnected

    @property
    def writable(self) -> bool:
        """`write_now` may be called: the client is there and the transport is under its high-water mark."""
        return not self._flow.write_paused and not self._cycle.disconnected

    def write_now(self, data: bytes) -> None:
        """Write `data` as the next part of the body without waiting (only while `writable`, or from
        `write`: what keeps the buffer bounded is that nobody writes past the high-water mark)."""
        if data:
            if self._chunked:
                self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            else:  # a close-delimited HTTP/1.0 body, or whatever else h11 chose: h11 frames it
                self._transport.write(self._cycle.conn.send(h11.Data(data=data)))


class WithRawBody:
    """An ASGI app wrapper for uvicorn's h11 protocol: each HTTP request's scope gets a `RawBody` for the
    cycle whose `send` it was given (GET, POST...; never HEAD, whose body uvicorn drops)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cycle = getattr(send, "__self__", None)
        if scope["type"] == "http" and scope.get("method") != "HEAD" and hasattr(cycle, "flow") \
                and hasattr(cycle, "conn"):
            extensions = scope.get("extensions")
            if extensions is None:
                extensions = scope["extensions"] = {}
            extensions[RAW_BODY] = RawBody(cycle)
        await self.app(scope, receive, send)
