"""DecodeGuardInterceptor builds a method's guarded handler once, not once per call (issue 19: a
Generate call paid ~2% of its frontend CPU at 2 tokens for the rebuild)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from shared_runtime.security.decode_guard import DecodeGuardInterceptor, MalformedRequest


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


async def _behaviour(request: Any, context: Any) -> None:
    """A coroutine writing its responses, as the Generate servicer is."""


def _intercept(guard: DecodeGuardInterceptor, handler: Any, method: str) -> Any:
    async def continuation(details: Any) -> Any:
        return handler

    return asyncio.run(guard.intercept_service(continuation, _Details(method)))


def test_a_methods_guarded_handler_is_built_once_and_reused() -> None:
    guard = DecodeGuardInterceptor()
    handler = grpc.unary_stream_rpc_method_handler(_behaviour, request_deserializer=bytes.decode)
    first = _intercept(guard, handler, "/s/Generate")
    assert first is not handler
    assert _intercept(guard, handler, "/s/Generate") is first
    assert isinstance(first.request_deserializer(b"\xff"), MalformedRequest)  # the guard is in place
    assert first.request_deserializer(b"ok") == "ok"


def test_a_new_handler_for_the_method_gets_its_own_guard() -> None:
    guard = DecodeGuardInterceptor()
    old = grpc.unary_unary_rpc_method_handler(_behaviour, request_deserializer=bytes.decode)
    new = grpc.unary_unary_rpc_method_handler(_behaviour, request_deserializer=bytes.decode)
    guarded_old = _intercept(guard, old, "/s/M")
    guarded_new = _intercept(guard, new, "/s/M")
    assert guarded_new is not guarded_old
    assert _intercept(guard, new, "/s/M") is guarded_new


def test_unknown_methods_and_streaming_requests_are_passed_through_and_not_stored() -> None:
    guard = DecodeGuardInterceptor()
    assert _intercept(guard, None, "/s/Nope") is None
    streaming = grpc.stream_stream_rpc_method_handler(_behaviour)
    assert _intercept(guard, streaming, "/s/Bidi") is streaming
    assert not guard._guarded
