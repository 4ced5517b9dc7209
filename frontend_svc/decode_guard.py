"""Malformed request bytes -> INVALID_ARGUMENT, without Python exception text.

grpcio parses a request with the method's `request_deserializer`; when the bytes are not a valid
message (corrupt wire format, a string field holding invalid UTF-8) it answers UNKNOWN with
"Unexpected <class 'google.protobuf.message.DecodeError'>: ...". `DecodeGuardInterceptor` swaps in a
deserializer that turns a parse failure into a `MalformedRequest` marker, and a behaviour that answers
such a call with INVALID_ARGUMENT naming only the expected message type. It applies to every method
with a single request message (the public API and health); streaming requests are left alone.
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
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        name = _message_name(handler_call_details.method)
        deserializer = _safe(handler.request_deserializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _guard_stream(handler.unary_stream, name), request_deserializer=deserializer,
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _guard_unary(handler.unary_unary, name), request_deserializer=deserializer,
            response_serializer=handler.response_serializer)
