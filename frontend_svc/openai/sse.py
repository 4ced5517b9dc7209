"""Server-Sent Events as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last.

`EventStream` is Starlette's streaming response with one guarantee added: `on_close` runs exactly
once when the response ends for any reason (finished, client disconnected, server shutting down), and
the body iterator is closed first, so the generation behind it is aborted in the engine even when the
iterator was suspended at a `yield` when the client went away (a cancelled `send` never reaches it).

Served by the HTTP edge (edge.py), the body's chunks are written with the request's `RawBody`
(raw_body.py) instead of one ASGI `send` each: the same bytes on the wire, the same backpressure, the
same disconnect watch (a task reading `receive` until `http.disconnect`, which cancels the body), and
the status line, the headers and the end of the body still go through `send`. Elsewhere (an ASGI test
client, another server) Starlette streams it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from frontend_svc.openai.raw_body import RAW_BODY, RawBody

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: str) -> str:
    """One SSE event carrying `data` (JSON has no raw newlines, so one `data:` line suffices)."""
    return f"data: {data}\n\n"


def events(chunks: Iterable[str]) -> str:
    """Several events in one write."""
    return "".join(f"data: {c}\n\n" for c in chunks)


class EventStream(StreamingResponse):
    """`text/event-stream` whose `on_close` runs once, after the body iterator is closed."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None, on_raw: Callable[[RawBody], None] | None = None) -> None:
        """`on_raw` is given the `RawBody` once the response started on it (not on Starlette's path)."""
        super().__init__(content, headers={**HEADERS, **(headers or {})})
        self._content = content
        self._on_close = on_close
        self._on_raw = on_raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            raw = scope.get("extensions", {}).get(RAW_BODY)
            if raw is None:
                await super().__call__(scope, receive, send)
            else:
                await self._stream_raw(raw, receive, send)
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self._on_close()

    async def _stream_raw(self, raw: RawBody, receive: Receive, send: Send) -> None:
        """The body through `raw`, raced against the client's disconnect (Starlette's shape for ASGI
        spec < 2.4: whichever ends first cancels the other); an error of the body is raised."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        raw.start()
        if self._on_raw is not None:
            self._on_raw(raw)
        body = asyncio.ensure_future(self._write_body(raw, send))
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((body, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            body.cancel()
            watch.cancel()
            await asyncio.wait((body, watch))
        if not body.cancelled():
            body.result()

    async def _write_body(self, raw: RawBody, send: Send) -> None:
        write = raw.write
        charset = self.charset
        async for chunk in self.body_iterator:
            data = chunk.encode(charset) if isinstance(chunk, str) else bytes(chunk)
            if not await write(data):
                return  # the client is gone: the watch ends the response
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
