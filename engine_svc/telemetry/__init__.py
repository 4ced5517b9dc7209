"""Engine observability: per-request OpenTelemetry spans and Prometheus metrics.

`EngineTelemetry` is what `EngineServer` takes: `spans` (None when tracing is off) are driven from the
asyncio side of the Connect streams; `metrics` (None when --metrics-port is 0) is fed once per step by
the busy loop and read at scrape time. The OTel set-up from `OTEL_*` and the /metrics server come from
`shared_runtime.telemetry`, which the frontend uses too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from engine_svc.telemetry.metrics import EngineMetrics
from engine_svc.telemetry.tracing import RequestSpans
from shared_runtime.telemetry import provider_from_env, serve_metrics, shutdown_telemetry

DEFAULT_SERVICE_NAME = "tandem-engine"

__all__ = ["EngineMetrics", "EngineTelemetry", "RequestSpans"]


@dataclass
class EngineTelemetry:
    spans: RequestSpans | None = None
    metrics: EngineMetrics | None = None
    provider: TracerProvider | None = None  # owned: flushed by `shutdown()`
    _http: list[Any] = field(default_factory=list)

    @classmethod
    def from_env(cls, model_name: str, metrics_port: int, host: str = "0.0.0.0") -> EngineTelemetry:
        """Tracing from `OTEL_*`; metrics served on `metrics_port` (0 = no metrics)."""
        provider = provider_from_env(DEFAULT_SERVICE_NAME)
        spans = RequestSpans(provider.get_tracer("tandem.engine"), model_name) if provider is not None else None
        telemetry = cls(spans, EngineMetrics(model_name) if metrics_port else None, provider)
        if telemetry.metrics is not None:
            server = serve_metrics(telemetry.metrics.registry, metrics_port, host)
            if server is not None:
                telemetry._http.append(server)
        return telemetry

    def shutdown(self) -> None:
        """Stop the /metrics server and flush spans still queued for export."""
        shutdown_telemetry(self._http, self.provider)
