"""Engine spans: one per traced request, parented by the request's `trace_headers`.

All of it runs on the engine's asyncio loop, never on the busy loop: a span starts when the `add`
arrives on a Connect stream and ends when that request's finishing output is written back. The
scheduler's events (queued, scheduled, preempted — each time —, first token, finished) are added with
the engine's own timestamps. Requests without `trace_headers` are not traced, and with tracing off
`RequestSpans` is not created at all, so an untraced step costs one emptiness check per message.

Invariants: a span's parent is only its own request's headers (contexts are passed explicitly, never
attached), so concurrent requests never share a trace; every started span ends exactly once — at its
finish, or when its stream closes.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from shared_runtime.contract import EngineCoreOutputs, EngineCoreRequest, ErrorCode, EventType, FinishReason

_EVENT_NAMES = {EventType.QUEUED: "queued", EventType.SCHEDULED: "scheduled",
                EventType.PREEMPTED: "preempted", EventType.FIRST_TOKEN: "first_token",
                EventType.FINISHED: "finished"}
_FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
                 FinishReason.ERROR: "error"}


class _Live:
    __slots__ = ("first_scheduled", "first_token", "num_preemptions", "num_tokens", "received", "span",
                 "stream_id")

    def __init__(self, span: Span, stream_id: int, received: float) -> None:
        self.span = span
        self.stream_id = stream_id
        self.received = received
        self.num_tokens = 0
        self.num_preemptions = 0
        self.first_scheduled: float | None = None
        self.first_token: float | None = None


def _ns(timestamp: float) -> int:
    return int(timestamp * 1e9)


def request_attributes(model_name: str, request: EngineCoreRequest) -> dict[str, Any]:
    """GenAI semantic-convention request attributes plus tandem's own."""
    sp = request.sampling_params
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "tandem",
        "gen_ai.request.model": model_name, "gen_ai.request.temperature": sp.temperature,
        "gen_ai.request.top_p": sp.top_p, "gen_ai.request.top_k": sp.top_k,
        "gen_ai.response.id": request.request_id,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
        "tandem.request.priority": request.priority,
    }
    if sp.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = sp.max_tokens
    if sp.seed is not None:
        attrs["gen_ai.request.seed"] = sp.seed
    if request.lora_name:
        attrs["tandem.request.lora_name"] = request.lora_name
    return attrs


class RequestSpans:
    """The live engine spans, by request id."""

    def __init__(self, tracer: Tracer, model_name: str) -> None:
        self.tracer = tracer
        self.model_name = model_name
        self._live: dict[str, _Live] = {}

    def __len__(self) -> int:
        return len(self._live)

    def start(self, stream_id: int, request: EngineCoreRequest) -> None:
        """Open the request's span if it carries trace headers (a reused live id is not re-traced)."""
        if not request.trace_headers or request.request_id in self._live:
            return
        now = time.time()
        span = self.tracer.start_span(
            f"text_completion {self.model_name}", context=propagate.extract(request.trace_headers),
            kind=SpanKind.SERVER, start_time=_ns(now), attributes=request_attributes(self.model_name, request))
        self._live[request.request_id] = _Live(span, stream_id, now)

    def observe(self, outputs: EngineCoreOutputs) -> None:
        """Add one message's events and tokens to their spans; end the spans of finished requests."""
        live = self._live
        if not live:
            return
        for out in outputs.outputs:
            entry = live.get(out.request_id)
            if entry is None:
                continue
            entry.num_tokens += len(out.new_token_ids)
            for event in out.events:
                self._add_event(entry, event.type, event.timestamp)
            if out.finish_reason:
                del live[out.request_id]
                self._finish(entry, out)

    def end_stream(self, stream_id: int) -> None:
        """The stream closed: its requests were aborted in the engine; end their spans as aborted."""
        for rid in [r for r, e in self._live.items() if e.stream_id == stream_id]:
            entry = self._live.pop(rid)
            entry.span.set_attributes({"gen_ai.response.finish_reasons": ["abort"],
                                       "gen_ai.usage.output_tokens": entry.num_tokens})
            entry.span.end()

    @staticmethod
    def _add_event(entry: _Live, kind: int, timestamp: float) -> None:
        if kind == EventType.SCHEDULED and entry.first_scheduled is None:
            entry.first_scheduled = timestamp
        elif kind == EventType.PREEMPTED:
            entry.num_preemptions += 1
        elif kind == EventType.FIRST_TOKEN:
            entry.first_token = timestamp
        name = _EVENT_NAMES.get(EventType(kind))
        if name is not None:
            entry.span.add_event(name, timestamp=_ns(timestamp))

    def _finish(self, entry: _Live, out: Any) -> None:
        span = entry.span
        attrs: dict[str, Any] = {
            "gen_ai.response.finish_reasons": [_FINISH_NAMES.get(FinishReason(out.finish_reason), "error")],
            "gen_ai.usage.output_tokens": entry.num_tokens,
            "gen_ai.usage.cache_read.input_tokens": out.num_cached_tokens,
            "tandem.num_preemptions": entry.num_preemptions,
        }
        if entry.first_scheduled is not None:
            attrs["tandem.time_in_queue_s"] = max(0.0, entry.first_scheduled - entry.received)
        if entry.first_token is not None:
            attrs["tandem.time_to_first_token_s"] = max(0.0, entry.first_token - entry.received)
        span.set_attributes(attrs)
        if out.error is not None:
            error_type = ErrorCode(out.error.code).name
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, out.error.message))
        span.end()
