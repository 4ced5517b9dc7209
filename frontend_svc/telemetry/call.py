"""`GenerateCall`: what one generation call reports — its span and its metrics — from arrival to end.

The same for every API (gRPC Generate, the HTTP completions endpoints). In order: `prepare` (validation
+ tokenization, traced as a child span), `trace_headers` (the context the engine requests carry),
`routed`, `on_delta` per delta handed to the client, then exactly one of `succeed` / `fail`. Per delta the work
is a clock read and, at most, two histogram observations; nothing is formatted or logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from frontend_svc.dispatcher import Migration
from frontend_svc.grpc_api.status import code_from_number
from frontend_svc.outputs import CompletionDelta
from frontend_svc.processor import PreparedRequest
from frontend_svc.telemetry.metrics import FrontendMetrics
from frontend_svc.telemetry.tracing import CallSpan, fail_span, request_attributes
from shared_runtime.violations import ValidationError


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

    def prepare(self, fn: Callable[[], PreparedRequest]) -> PreparedRequest:
        """Run `fn()` (validate + tokenize) under a child span; ValidationError passes through."""
        child = self.span.child("tandem.frontend.prepare")
        try:
            prepared = fn()
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
                                      "tandem.request.n": len(prepared.engine_request_ids),
                                      **({"tandem.request.lora_name": prepared.lora_name} if prepared.lora_name
                                         else {})})
        return prepared

    def trace_headers(self) -> dict[str, str]:
        """This call's trace context, for the engine requests it sends (W3C propagation headers)."""
        return self.span.trace_headers()

    def routed(self, engine: str, num_engine_requests: int) -> None:
        self.span.set_attributes({"tandem.engine.address": engine})
        if self._metrics is not None:
            self._metrics.engine_requests.labels(self._model_name, engine).inc(num_engine_requests)

    def migrated(self, migration: Migration) -> None:
        """The request moved to another engine (or could not): an event on the call's span; the continuation's
        engine span joins the same trace (its trace headers travel with it)."""
        attributes: dict[str, str | int] = {"tandem.migration.reason": migration.reason,
                                            "tandem.migration.number": migration.number,
                                            "tandem.migration.from": migration.from_address}
        if migration.to_address is not None:
            attributes["tandem.migration.to"] = migration.to_address
        self.span.add_event("tandem.request.migrated" if migration.to_address else "tandem.request.migration_failed",
                            attributes)

    def on_delta(self, delta: CompletionDelta) -> None:
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

    def fail(self, code: str, message: str) -> None:
        """End with the status the call ends with: `code` is a gRPC status code name (an HTTP API maps
        its outcome to one: CANCELLED for a client that went away, ...)."""
        if self._ended:
            return
        self._ended = True
        self.span.set_attributes({"gen_ai.usage.output_tokens": self._num_tokens})
        self.span.end(code, message or code)
        if self._metrics is not None:
            self._metrics.failure.labels(self._model_name, code).inc()


def grpc_failure(exc: BaseException | None, context: Any) -> tuple[str, str]:
    """(status code name, message) of a gRPC call that ends with `exc` (read after an abort), or with the
    status its handler set (`exc` None)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
        return code, code
    number = context.code()
    if isinstance(number, grpc.StatusCode):
        code = str(number.name)
    elif isinstance(number, int):
        code = str(code_from_number(number).name)
    else:
        code = "UNKNOWN"
    return code, str(context.details() or code)
