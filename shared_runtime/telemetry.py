"""Telemetry set-up that both services share: OpenTelemetry from `OTEL_*`, /metrics, shutdown.

It lives in the `tandem` package (beside the wire contracts) because both services import it and
neither may import the other.

Tracing is on when the environment names an exporter: `OTEL_TRACES_EXPORTER` (`otlp`, `console`, or a
comma list; `none` turns it off) or, with that unset, an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` /
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`). `OTEL_SDK_DISABLED=true` always wins. With nothing configured
`provider_from_env` returns None and the services do no span work at all.

Everything else is the SDK's own reading of the environment: the sampler (`OTEL_TRACES_SAMPLER[_ARG]`),
the resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), the batch processor (`OTEL_BSP_*`) and
the exporter (`OTEL_EXPORTER_OTLP_*`, protocol `grpc` or `http/protobuf`). Context propagation uses the
global propagator (`OTEL_PROPAGATORS`, default W3C tracecontext + baggage). The provider is returned,
never installed globally, so several services (or tests) can live in one process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

logger = logging.getLogger(__name__)

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def exporter_names(env: Mapping[str, str]) -> list[str]:
    """The trace exporters the environment asks for ([] = tracing off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = env.get("OTEL_TRACES_EXPORTER")
    if names is None:
        return ["otlp"] if any(env.get(v) for v in _ENDPOINT_VARS) else []
    return [n.strip().lower() for n in names.split(",") if n.strip() and n.strip().lower() != "none"]


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        except ImportError as exc:
            raise RuntimeError("OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf needs the "
                               "opentelemetry-exporter-otlp-proto-http package") from exc
        exporter: SpanExporter = HttpExporter()
        return exporter
    raise RuntimeError(f"unsupported OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} (use grpc or http/protobuf)")


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "otlp":
        return _otlp_exporter(env)
    if name == "console":
        return ConsoleSpanExporter()
    raise RuntimeError(f"unsupported OTEL_TRACES_EXPORTER {name!r} (use otlp, console or none)")


def provider_from_env(default_service_name: str, env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """A TracerProvider with a batch processor per configured exporter, or None when tracing is off.

    `default_service_name` applies only when `OTEL_SERVICE_NAME` is unset. Call `shutdown()` on the
    result at exit to flush the last spans.
    """
    env = os.environ if env is None else env
    names = exporter_names(env)
    if not names:
        return None
    resource = Resource.create({} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service_name})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER[_ARG]
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, env)))
    logger.info("tracing on: exporters %s, sampler %s", ",".join(names), provider.sampler.get_description())
    return provider


def serve_metrics(registry: Any, port: int, host: str = "0.0.0.0") -> Any:
    """Serve `registry` at http://host:port/metrics on a daemon thread, inside the limits of
    `shared_runtime.metrics_http`; None (logged) if the port is taken."""
    from shared_runtime.metrics_http import start_metrics_server

    try:
        server = start_metrics_server(host, port, registry)
    except OSError as exc:
        logger.error("cannot serve /metrics on %s:%d (%s); continuing without metrics", host, port, exc)
        return None
    logger.info("metrics on http://%s:%d/metrics", host, port)
    return server


def shutdown_telemetry(http_servers: list[Any], provider: TracerProvider | None) -> None:
    """Stop the /metrics servers (the list is emptied) and flush spans still queued for export."""
    for server in http_servers:
        server.shutdown()
        server.server_close()
    http_servers.clear()
    if provider is not None:
        provider.shutdown()
