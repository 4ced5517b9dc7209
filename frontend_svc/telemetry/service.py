"""`FrontendTelemetry`: what `FrontendServer` holds — `begin_call()` per Generate call, `observe_step`
for what the output processor hands out per engine message, `observe_migration` for each request moved to
another engine, and the engine gauges it wires in. `FrontendTelemetry.off()` (the default) creates no spans and
no metrics; `from_env()` reads `OTEL_*` (see `shared_runtime.telemetry`) and serves /metrics on a port.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from frontend_svc.dispatcher import Migration
from frontend_svc.output_processor import ProcessedOutputs
from frontend_svc.telemetry.call import GenerateCall
from frontend_svc.telemetry.metrics import FrontendMetrics
from frontend_svc.telemetry.tracing import CallSpan
from shared_runtime.telemetry import provider_from_env, serve_metrics, shutdown_telemetry

logger = logging.getLogger(__name__)
DEFAULT_SERVICE_NAME = "tandem-frontend"
GENERATE_METHOD = "tandem.v1.GenerationService/Generate"


@dataclass
class FrontendTelemetry:
    model_name: str = ""
    tracer: Tracer | None = None
    metrics: FrontendMetrics | None = None
    provider: TracerProvider | None = None  # owned: flushed by `shutdown()`
    _http: list[Any] = field(default_factory=list)

    @classmethod
    def off(cls) -> FrontendTelemetry:
        return cls()

    @classmethod
    def from_env(cls, model_name: str, metrics_port: int, host: str = "0.0.0.0") -> FrontendTelemetry:
        """Tracing from `OTEL_*`; metrics served on `metrics_port` (0 = no metrics)."""
        provider = provider_from_env(DEFAULT_SERVICE_NAME)
        tracer = provider.get_tracer("tandem.frontend") if provider is not None else None
        telemetry = cls(model_name, tracer, FrontendMetrics(model_name) if metrics_port else None, provider)
        if telemetry.metrics is not None:
            server = serve_metrics(telemetry.metrics.registry, metrics_port, host)
            if server is not None:
                telemetry._http.append(server)
        return telemetry

    def begin_call(self, metadata: Sequence[tuple[str, str]] | None, method: str = GENERATE_METHOD,
                   attributes: dict[str, str] | None = None) -> GenerateCall:
        """A call's telemetry. `metadata` (gRPC metadata or HTTP headers, lower-case keys) carries the
        client's W3C trace context; `method` names the span ("POST /v1/chat/completions" for HTTP, with
        `attributes` such as http.request.method / http.route; gRPC's rpc.* by default)."""
        span = CallSpan(self.tracer, metadata, method, attributes)
        return GenerateCall(span, self.metrics, self.model_name)

    @property
    def logs_stats(self) -> bool:
        """Whether the output processor should hand out per-step stats (metrics are on)."""
        return self.metrics is not None

    def observe_step(self, processed: ProcessedOutputs) -> None:
        if self.metrics is not None:
            self.metrics.observe_step(processed)

    def observe_migration(self, migration: Migration) -> None:
        """A request moved to another engine (or could not): the counter, and one log line."""
        outcome = "moved" if migration.to_address is not None else "failed"
        if self.metrics is not None:
            self.metrics.migrations.labels(self.metrics.model_name, migration.reason, outcome).inc()
        if migration.to_address is None:
            logger.warning("request %s could not move off engine %s (%s, move %d)", migration.request_id,
                           migration.from_address, migration.reason, migration.number)

    def watch_engines(self, connections: Callable[[], Iterable[Any]]) -> None:
        if self.metrics is not None:
            self.metrics.watch_engines(connections)

    def shutdown(self) -> None:
        """Stop the /metrics server and flush spans still queued for export."""
        shutdown_telemetry(self._http, self.provider)
