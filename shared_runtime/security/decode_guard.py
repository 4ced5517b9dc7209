"""Malformed request bytes -> INVALID_ARGUMENT, without Python exception text.

grpcio parses a request with the method's `request_deserializer`; when the bytes are not a valid
message (corrupt wire format, a string field holding invalid UTF-8) it answers UNKNOWN with
"Unexpected <class 'google.protobuf.message.DecodeError'>: ...". `DecodeGuardInterceptor` swaps in a
deserializer that turns a parse failure into a `MalformedRequest` marker, and a behaviour that answers
such a call with INVALID_ARGUMENT naming only the expected message type. It applies to every method
with a single request message (the frontend's public API, the engine's SMG protocol and unary calls,
health on both); request streams (the engine's `Connect`) are left alone: they check their own input.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class MalformedRequest:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ()


_MALFORMED = MalformedRequest()


def _safe(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, UnicodeDecodeError, ValueError):
            return _MALFORMED
    return parse


def _message_name(method: str) -> str:
    return method.rsplit("/", 1)[-1]


def _guard_unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    message = f"the request is not a valid {method} request message"

    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request is _MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        return await behavior(request, context)
    return guarded


def _guard_stream(behavior: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., Any]:
    message = f"the request is not a valid {method} request message"
    if not inspect.isasyncgenfunction(behavior):  # a coroutine writing with context.write
        return _guard_unary(behavior, method)  # type: ignore[arg-type]

    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if request is _MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        async for response in behavior(request, context):
            yield response
    return guarded


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Guards every method with a single request message.

    Invariant: a method's guarded handler is built once, the first time it is called, and reused for
    as long as gRPC hands out the same handler object for it (what a server's registered handlers do);
    so a call pays one dictionary lookup here, not a new handler, closures and an `inspect` check
    (bench/frontend_capacity.py --calls; BENCHMARKS.md). The cache holds
    one entry per method gRPC found a handler for: unknown method names are never stored."""

    def __init__(self) -> None:
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        guarded = _guarded_handler(handler, _message_name(method))
        self._guarded[method] = (handler, guarded)
        return guarded


def _guarded_handler(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    """`handler` with the malformed-bytes guard: its deserializer and behaviour wrapped."""
    deserializer = _safe(handler.request_deserializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _guard_stream(handler.unary_stream, name), request_deserializer=deserializer,
            response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        _guard_unary(handler.unary_unary, name), request_deserializer=deserializer,
        response_serializer=handler.response_serializer)
