"""Traces across the split (in-process engine + frontend servers, in-memory exporter), plus unit tests
of the engine's span bookkeeping and the `OTEL_*` set-up."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from tandem.v1 import generation_pb2_grpc as pb_grpc

from engine_svc.telemetry.tracing import RequestSpans
from frontend_svc.client import generate_request
from shared_runtime.contract import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineError,
    EngineSamplingParams,
    ErrorCode,
    EventType,
    FinishReason,
    RequestEvent,
)
from shared_runtime.telemetry import exporter_names, provider_from_env
from tests.observability.support import Stack
from tests.support import wait_until

GENERATE = "tandem.v1.GenerationService/Generate"


def traceparent(i: int) -> tuple[str, int, int]:
    trace_id, span_id = 0xABC0000 + i, 0x1000 + i
    return f"00-{trace_id:032x}-{span_id:016x}-01", trace_id, span_id


def generate(stack: Stack, request: Any, metadata: list[tuple[str, str]] | None = None) -> list[Any]:
    with grpc.insecure_channel(f"127.0.0.1:{stack.frontend_port}") as channel:
        return list(pb_grpc.GenerationServiceStub(channel).Generate(request, metadata=metadata, timeout=60))


def spans_of(stack: Stack, trace_id: int, count: int) -> list[Any]:
    def found() -> list[Any]:
        return [s for s in stack.exporter.get_finished_spans() if s.context.trace_id == trace_id]
    wait_until(lambda: len(found()) >= count, 20, f"{count} spans")
    return found()


def service(span: Any) -> str:
    return str(span.resource.attributes["service.name"])


def test_one_trace_from_client_through_frontend_to_engine(stack: Stack) -> None:
    header, trace_id, client_span_id = traceparent(1)
    responses = generate(stack, generate_request(token_ids=[5, 6, 7, 8, 9], request_id="t1", max_tokens=4,
                                                 temperature=0.0, ignore_eos=True), [("traceparent", header)])
    assert sum(len(r.token_ids) for r in responses) == 4
    spans = spans_of(stack, trace_id, 3)
    server = next(s for s in spans if s.name == GENERATE)
    prepare = next(s for s in spans if s.name == "tandem.frontend.prepare")
    engine = next(s for s in spans if service(s) == "tandem-engine")
    assert len(spans) == 3
    assert service(server) == "tandem-frontend" and server.kind == SpanKind.SERVER
    assert server.parent.span_id == client_span_id and server.parent.is_remote
    assert prepare.parent.span_id == server.context.span_id
    assert engine.parent.span_id == server.context.span_id
    assert server.attributes["gen_ai.request.model"] == engine.attributes["gen_ai.request.model"]
    assert server.attributes["gen_ai.usage.output_tokens"] == 4
    assert server.attributes["gen_ai.response.finish_reasons"] == ("length",)
    attrs = engine.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.provider.name"] == "tandem"
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.usage.input_tokens"] == 5
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert str(attrs["gen_ai.response.id"]).startswith("t1-0-")
    assert attrs["tandem.num_preemptions"] == 0
    assert 0 <= attrs["tandem.time_in_queue_s"] <= attrs["tandem.time_to_first_token_s"]
    names = [e.name for e in engine.events]
    assert names == ["queued", "scheduled", "first_token", "finished"]
    stamps = [e.timestamp for e in engine.events]
    assert stamps == sorted(stamps)
    assert engine.status.status_code == StatusCode.UNSET


def test_each_completion_gets_its_own_engine_span(stack: Stack) -> None:
    header, trace_id, _ = traceparent(2)
    generate(stack, generate_request(token_ids=[11] * 20, max_tokens=3, n=2, temperature=0.8, seed=1,
                                     ignore_eos=True),
             [("traceparent", header)])
    spans = spans_of(stack, trace_id, 4)
    server = next(s for s in spans if s.name == GENERATE)
    engine = [s for s in spans if service(s) == "tandem-engine"]
    assert len(engine) == 2
    assert {s.parent.span_id for s in engine} == {server.context.span_id}
    assert len({s.attributes["gen_ai.response.id"] for s in engine}) == 2


def test_concurrent_requests_keep_their_own_traces(stack: Stack) -> None:
    def one(i: int) -> None:
        header, _, _ = traceparent(100 + i)
        generate(stack, generate_request(token_ids=[20 + i] * (8 + i), request_id=f"c{i}", max_tokens=3 + i,
                                         temperature=0.0, ignore_eos=True), [("traceparent", header)])

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(6)))
    for i in range(6):
        _, trace_id, client_span_id = traceparent(100 + i)
        spans = spans_of(stack, trace_id, 3)
        assert len(spans) == 3, [s.name for s in spans]
        server = next(s for s in spans if s.name == GENERATE)
        engine = next(s for s in spans if service(s) == "tandem-engine")
        assert server.parent.span_id == client_span_id
        assert engine.parent.span_id == server.context.span_id
        assert str(engine.attributes["gen_ai.response.id"]).startswith(f"c{i}-0-")
        assert engine.attributes["gen_ai.usage.output_tokens"] == 3 + i


def test_invalid_request_marks_the_span_failed_and_reaches_no_engine(stack: Stack) -> None:
    header, trace_id, _ = traceparent(3)
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, generate_request(token_ids=[1, 2], temperature=-1.0), [("traceparent", header)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = spans_of(stack, trace_id, 2)
    assert {s.name for s in spans} == {GENERATE, "tandem.frontend.prepare"}
    for span in spans:
        assert span.status.status_code == StatusCode.ERROR
        assert span.attributes["error.type"] == "INVALID_ARGUMENT"


def test_a_call_without_traceparent_starts_a_trace_the_engine_joins(stack: Stack) -> None:
    before = {s.context.trace_id for s in stack.exporter.get_finished_spans()}
    generate(stack, generate_request(token_ids=[3, 4, 5], request_id="root", max_tokens=2, ignore_eos=True))

    def new_servers() -> list[Any]:
        return [s for s in stack.exporter.get_finished_spans()
                if s.name == GENERATE and s.context.trace_id not in before]
    wait_until(lambda: len(new_servers()) == 1, 30, "one new server span")
    server = new_servers()[0]
    assert server.parent is None
    engine = spans_of(stack, server.context.trace_id, 3)
    assert any(service(s) == "tandem-engine" and s.parent.span_id == server.context.span_id for s in engine)


# ---- unit tests ------------------------------------------------------------------------------------
def _request(rid: str, headers: dict[str, str]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3], trace_headers=headers,
                             sampling_params=EngineSamplingParams(temperature=0.5, max_tokens=8, seed=7))


def _spans() -> tuple[RequestSpans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestSpans(provider.get_tracer("t"), "m"), exporter


def test_engine_spans_count_preemptions_and_record_errors() -> None:
    spans, exporter = _spans()
    header, trace_id, parent = traceparent(7)
    spans.start(1, _request("a", {"traceparent": header}))
    spans.start(1, _request("untraced", {}))
    assert len(spans) == 1
    ev = [RequestEvent(EventType.QUEUED, 10.0), RequestEvent(EventType.SCHEDULED, 10.5),
          RequestEvent(EventType.PREEMPTED, 11.0), RequestEvent(EventType.SCHEDULED, 11.5),
          RequestEvent(EventType.PREEMPTED, 12.0)]
    spans.observe(EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="a", events=ev),
                                             EngineCoreOutput(request_id="untraced", new_token_ids=[4])]))
    spans.observe(EngineCoreOutputs(outputs=[EngineCoreOutput(
        request_id="a", finish_reason=FinishReason.ERROR, events=[RequestEvent(EventType.FINISHED, 13.0)],
        error=EngineError(code=ErrorCode.UNAVAILABLE, message="engine failed"))]))
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_id == trace_id and span.parent.span_id == parent
    assert [e.name for e in span.events] == ["queued", "scheduled", "preempted", "scheduled", "preempted",
                                             "finished"]
    assert span.events[2].timestamp == 11_000_000_000
    assert span.attributes["tandem.num_preemptions"] == 2
    assert span.attributes["gen_ai.request.seed"] == 7
    assert "tandem.request.lora_name" not in span.attributes  # the base model
    assert span.attributes["error.type"] == "UNAVAILABLE"
    assert span.status.status_code == StatusCode.ERROR
    assert len(spans) == 0


def test_engine_spans_end_when_their_stream_closes() -> None:
    spans, exporter = _spans()
    spans.start(1, _request("a", {"traceparent": traceparent(8)[0]}))
    spans.start(2, _request("b", {"traceparent": traceparent(9)[0]}))
    spans.end_stream(1)
    (span,) = exporter.get_finished_spans()
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert len(spans) == 1


@pytest.mark.parametrize(("env", "expected"), [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "true"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_TRACES_EXPORTER": "none"}, []),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["console", "otlp"]),
])
def test_exporters_come_from_the_environment(env: dict[str, str], expected: list[str]) -> None:
    assert exporter_names(env) == expected


def test_provider_from_env_names_the_service_and_reads_the_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    assert provider_from_env("tandem-engine", {}) is None
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = provider_from_env("tandem-engine", {"OTEL_TRACES_EXPORTER": "console"})
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "tandem-engine"
        assert "0.25" in provider.sampler.get_description()
    finally:
        provider.shutdown()


def test_an_engine_span_names_the_requests_lora_adapter() -> None:
    spans, exporter = _spans()
    request = msgspec.structs.replace(_request("a", {"traceparent": traceparent(10)[0]}), lora_name="sql")
    spans.start(1, request)
    spans.end_stream(1)
    (span,) = exporter.get_finished_spans()
    assert span.attributes["tandem.request.lora_name"] == "sql"
