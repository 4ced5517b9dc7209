"""Server-Sent Events as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` last.

`EventStream` is Starlette's streaming response with one guarantee added: `on_close` runs exactly
once when the response ends for any reason (finished, client disconnected, server shutting down), and
the body iterator is closed first, so the generation behind it is aborted in the engine even when the
iterator was suspended at a `yield` when the client went away (a cancelled `send` never reaches it).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

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
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={**HEADERS, **(headers or {})})
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self._on_close()
