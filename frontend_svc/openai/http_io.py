"""An HTTP request's plumbing shared by every OpenAI-style route: its body read and parsed under limits, its
id, its headers, its client's disconnect, and errors as OpenAI's JSON error response.

Invariants:
- A body is read only up to its limit: Content-Length over it is refused before reading, and reading
  stops as soon as the bytes received exceed it (413).
- Before a JSON body is parsed, its commas and opening braces are counted on the raw bytes (C speed,
  ~1 ms per MB) against `BodyLimits` (shared_runtime/limits.py: what a request that fits max_model_len
  can hold); more is a 400 at once. Parsing holds the GIL even on a thread, so this count is what bounds
  how long one body's parse can stall every stream.
- A body larger than `INLINE_PARSE_BYTES` is parsed on a thread, never on the event loop, and one such
  parse runs at a time per event loop (the parse lane): eight big bodies at once stall other streams as
  long as one does, not eight times as long, since the loop gets the GIL back between two parses.
"""

from __future__ import annotations

import asyncio
import json
import uuid
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive

from frontend_svc.openai.errors import ApiError, bad_request, from_pydantic, too_large
from shared_runtime import limits

M = TypeVar("M", bound=pydantic.BaseModel)
T = TypeVar("T")
INLINE_PARSE_BYTES = 64 * 1024  # larger bodies are parsed on a thread
JSON = "application/json"


def error_response(error: ApiError) -> Response:
    return Response(error.json(), status_code=error.status, media_type=JSON, headers=error.headers)


async def guarded(request: Request, handler: Callable[[Request], Awaitable[Response]]) -> Response:
    """`handler(request)`, its `ApiError` as OpenAI's error response."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)


@dataclass(frozen=True)
class BodyLimits:
    """What one JSON body may hold: bytes (413), commas and opening braces (400, counted before parsing)."""

    max_bytes: int
    max_commas: int
    max_objects: int

    @classmethod
    def for_model(cls, max_bytes: int, max_model_len: int, vocab_size: int) -> BodyLimits:
        return cls(max_bytes, limits.max_json_commas(max_model_len, vocab_size),
                   limits.max_json_objects(max_model_len))

    def check(self, raw: bytes) -> None:
        """400 when `raw` holds more commas or opening braces than a request within these limits can."""
        for mark, what, bound in ((b",", "commas (array elements and object members)", self.max_commas),
                                  (b"{", "objects ('{')", self.max_objects)):
            count = raw.count(mark)
            if count > bound:
                raise bad_request(f"the request body holds {count} {what}; a request that fits this model's "
                                  f"context holds at most {bound}")


async def parse_body(request: Request, body_limits: BodyLimits, model: type[M]) -> M:
    """The body validated as `model` (pydantic; on the parse lane when it is large) after its counts were
    checked; 400/413 as `ApiError`."""
    raw = await read_json_body(request, body_limits)
    try:
        return await off_loop_if_large(raw, model.model_validate_json, raw)
    except pydantic.ValidationError as exc:
        raise from_pydantic(exc) from None


async def read_json_body(request: Request, body_limits: BodyLimits) -> bytes:
    """The body's bytes, within `body_limits` (413 past its size, 400 past its counts)."""
    raw = await read_body(request, body_limits.max_bytes)
    body_limits.check(raw)
    return raw


_PARSE_LANES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


async def off_loop_if_large(raw: bytes, fn: Callable[[Any], T], arg: Any) -> T:
    """`fn(arg)`, on a thread when `raw` (the body it works on) is large, one at a time per event loop (the
    parse lane: a parse holds the GIL, so the loop runs between two, never during one)."""
    if len(raw) <= INLINE_PARSE_BYTES:
        return fn(arg)
    loop = asyncio.get_running_loop()
    lane = _PARSE_LANES.get(loop)
    if lane is None:
        lane = _PARSE_LANES[loop] = asyncio.Semaphore(1)
    async with lane:
        return await asyncio.to_thread(fn, arg)


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 otherwise."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise bad_request("the body is not valid JSON") from None
    except RecursionError:  # json.loads recurses per nesting level: a 400, not a 500 with a traceback
        raise bad_request("the body is not valid JSON: it is nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    return data


async def read_body(request: Request, limit: int) -> bytes:
    """The request body; 413 when Content-Length or the bytes received exceed `limit` (nothing more is read)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad_request("invalid Content-Length")
        if int(length) > limit:
            raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut off by the body timeout (edge.py): nobody reads the answer
        raise ApiError(408, "the request body did not arrive") from None
    return b"".join(chunks)


class Disconnected:
    """What `unless_disconnected` returns when the client went away first."""


DISCONNECTED = Disconnected()


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | Disconnected:
    """`work`'s result, or DISCONNECTED (work cancelled) if the client disconnects first. Raises what
    `work` raises.

    The task running `work` is referenced by this frame alone, and this frame drops it before returning
    or raising: a task keeps its exception, whose traceback holds this frame and its caller's, so a task
    held by any of them would make a reference cycle that keeps everything the failed work touched (a
    refused request's parsed body) until a full garbage collection."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its end, without its exception (and without hiding our own cancel)
            return DISCONNECTED
        return task.result()
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
        del task, watch


async def collected_answer(request: Request, answer: Coroutine[Any, Any, str], close: Callable[[], None],
                           headers: dict[str, str]) -> Response:
    """A non-streamed answer: `answer`'s JSON body, or 499 when the client leaves first; `close` (the
    request's end) runs either way."""
    try:
        body = await unless_disconnected(request, answer)
        if isinstance(body, Disconnected):
            return Response(status_code=499)
        return Response(body, media_type=JSON, headers=headers)
    finally:
        close()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def pick_request_id(request: Request, in_body: str | None = None) -> str:
    """The client's X-Request-Id, else the body's `request_id` (vLLM's order; either validated like the
    gRPC request_id), else a new one."""
    given, name = request.headers.get("x-request-id"), "X-Request-Id"
    if given is None:
        given, name = in_body, "request_id"
    if given is None:
        return uuid.uuid4().hex
    bad = limits.request_id_violation(given)
    if bad is not None or not given:
        raise bad_request(f"{name} {bad.description if bad else 'must not be empty'}", name)
    return given


def header_pairs(request: Request) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]
