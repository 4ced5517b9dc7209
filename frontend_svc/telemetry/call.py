"""`GenerateCall`: what one Generate call reports — its span and its metrics — from arrival to end.

The servicer calls, in order: `prepare` (validation + tokenization, traced as a child span),
`engine_requests` (adds the propagation headers), `routed`, `on_delta` per response, then exactly one
of `succeed` / `fail`. Per response the work is a clock read and, at most, two histogram observations;
nothing is formatted or logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from frontend_svc.errors import ValidationError
from frontend_svc.telemetry.metrics import FrontendMetrics
from frontend_svc.telemetry.tracing import CallSpan, fail_span, request_attributes


class GenerateCall:
    __slots__ = (
        "_ended",
        "_finish_reason",
        "_first",
        "_last",
        "_metrics",
        "_model_name",
        "_num_tokens",
        "_prompt_tokens",
        "_start",
        "span",
    )

    def __init__(self, span: CallSpan, metrics: FrontendMetrics | None, model_name: str) -> None:
        self.span = span
        self._metrics = metrics
        self._model_name = model_name
        self._start = time.monotonic()
        self._first: float | None = None
        self._last: list[float] = []  # per completion index: time of its previous response with tokens
        self._num_tokens = 0
        self._prompt_tokens = 0
        self._finish_reason: str | None = None
        self._ended = False

    def prepare(self, fn: Callable[[Any], Any], request: Any) -> Any:
        """Run `fn(request)` (validate + tokenize) under a child span; ValidationError passes through."""
        child = self.span.child("tandem.frontend.prepare")
        try:
            prepared = fn(request)
        except ValidationError as exc:
            fail_span(child, "INVALID_ARGUMENT", str(exc))
            raise
        self._prompt_tokens = len(prepared.prompt_token_ids)
        self._last = [0.0] * max(1, len(prepared.engine_request_ids))
        if child is not None:
            child.set_attribute("gen_ai.usage.input_tokens", self._prompt_tokens)
            child.end()
            self.span.set_attributes({**request_attributes(self._model_name, prepared.params,
                                                           self._prompt_tokens, prepared.priority),
                                      "gen_ai.response.id": prepared.request_id,
                                      "tandem.request.n": len(prepared.engine_request_ids)})
        return prepared

    def engine_requests(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Give every engine request (one per completion) this call's trace context."""
        headers = self.span.trace_headers()
        if headers:
            for fields in requests:
                fields["trace_headers"] = dict(headers)
        return requests

    def routed(self, engine: str, num_engine_requests: int) -> None:
        self.span.set_attributes({"tandem.engine.address": engine})
        if self._metrics is not None:
            self._metrics.engine_requests.labels(self._model_name, engine).inc(num_engine_requests)

    def on_delta(self, delta: Any) -> None:
        if delta.token_ids:
            now = time.monotonic()
            metrics = self._metrics
            if self._first is None:
                self._first = now
                self.span.add_event("first_token")
                if metrics is not None:
                    metrics.ttft.observe(now - self._start)
            index = delta.index
            if self._last[index] and metrics is not None:
                metrics.itl.observe(now - self._last[index])
            self._last[index] = now
            self._num_tokens += len(delta.token_ids)
        if delta.finish_reason is not None and (self._finish_reason is None or delta.index == 0):
            self._finish_reason = delta.finish_reason

    def succeed(self) -> None:
        if self._ended:
            return
        self._ended = True
        reason = self._finish_reason or "stop"
        self.span.set_attributes({"gen_ai.response.finish_reasons": [reason],
                                  "gen_ai.usage.output_tokens": self._num_tokens})
        self.span.end()
        metrics = self._metrics
        if metrics is not None:
            metrics.success.labels(self._model_name, reason).inc()
            metrics.e2e.observe(time.monotonic() - self._start)
            metrics.prompt_tokens.observe(self._prompt_tokens)
            metrics.generation_tokens.observe(self._num_tokens)

    def fail(self, exc: BaseException, context: Any) -> None:
        """End with the status the call ends with (read from `context` after an abort)."""
        if self._ended:
            return
        self._ended = True
        code = failure_code(exc, context)
        self.span.set_attributes({"gen_ai.usage.output_tokens": self._num_tokens})
        self.span.end(code, str(context.details() or code))
        if self._metrics is not None:
            self._metrics.failure.labels(self._model_name, code).inc()


def failure_code(exc: BaseException, context: Any) -> str:
    """The gRPC status name a call ending with `exc` gets."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    if isinstance(code, int):
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    return "UNKNOWN"
