"""Frontend spans: one SERVER span per `Generate` call, a child span for validation + tokenization,
and the span's context handed to the engine in each engine request's `trace_headers`.

Invariants:
- A call's span is parented only by that call's own gRPC metadata (`traceparent`/`tracestate`): the
  context is always passed explicitly and never attached to the (shared) current context, so
  concurrent calls cannot leak into each other's traces.
- With tracing off (`tracer is None`) nothing is created; a client `traceparent` is still forwarded
  verbatim to the engine so that an engine with tracing on can join the client's trace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

PROPAGATION_KEYS = ("traceparent", "tracestate")
OPERATION = "text_completion"
PROVIDER = "tandem"


def carrier_from_metadata(metadata: Iterable[Any] | None) -> dict[str, str]:
    """The W3C propagation headers of a call's invocation metadata (gRPC keys are lower-case)."""
    carrier: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        if key in PROPAGATION_KEYS and isinstance(value, str):
            carrier[key] = value
    return carrier


def request_attributes(model_name: str, params: Any, prompt_tokens: int, priority: int) -> dict[str, Any]:
    """GenAI semantic-convention request attributes (unset sampling fields are left out)."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": OPERATION, "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": model_name, "gen_ai.usage.input_tokens": prompt_tokens,
        "tandem.request.priority": priority,
    }
    for attr, value in (("max_tokens", params.max_tokens), ("temperature", params.temperature),
                        ("top_p", params.top_p), ("top_k", params.top_k), ("seed", params.seed)):
        if value is not None:
            attrs[f"gen_ai.request.{attr}"] = value
    return attrs


class CallSpan:
    """The span of one Generate call (or just the client's carrier, when tracing is off)."""

    __slots__ = ("_ctx", "carrier", "span", "tracer")

    def __init__(self, tracer: Tracer | None, metadata: Iterable[Any] | None, method: str,
                 attributes: dict[str, str] | None = None) -> None:
        """`method`: the span name; `attributes`: the transport's (default: a gRPC method's rpc.*)."""
        self.tracer = tracer
        self.carrier = carrier_from_metadata(metadata)
        self.span: Span | None = None
        self._ctx: Context | None = None
        if tracer is not None:
            parent = propagate.extract(self.carrier) if self.carrier else Context()
            if attributes is None:
                attributes = {"rpc.system": "grpc", "rpc.service": method.rsplit("/", 1)[0],
                              "rpc.method": method.rsplit("/", 1)[-1]}
            self.span = tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes=attributes)
            self._ctx = trace.set_span_in_context(self.span)

    def child(self, name: str) -> Span | None:
        """A child span of the call (the caller ends it), or None when tracing is off."""
        if self.tracer is None:
            return None
        return self.tracer.start_span(name, context=self._ctx)

    def trace_headers(self) -> dict[str, str]:
        """What the engine needs to parent its span here: this span's context, or the client's."""
        if self._ctx is None:
            return dict(self.carrier)
        headers: dict[str, str] = {}
        propagate.inject(headers, context=self._ctx)
        return {k: v for k, v in headers.items() if k in PROPAGATION_KEYS}

    def set_attributes(self, attrs: Mapping[str, Any]) -> None:
        if self.span is not None:
            self.span.set_attributes(attrs)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        if self.span is not None:
            self.span.add_event(name, attributes=dict(attributes) if attributes else None)

    def end(self, error_type: str | None = None, message: str = "") -> None:
        span = self.span
        if span is None:
            return
        if error_type is not None:
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, message or error_type))
        span.end()


def fail_span(span: Span | None, error_type: str, message: str) -> None:
    """Mark a child span failed and end it."""
    if span is None:
        return
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message))
    span.end()
