"""Frontend observability: OpenTelemetry spans and Prometheus metrics for `tandem.v1.GenerationService`.

- `tracing.py`: the Generate call's span and the headers handed to the engine.
- `metrics.py`: the frontend's Prometheus series.
- `call.py`: `GenerateCall`, one call's span + metrics from arrival to end.
- `service.py`: `FrontendTelemetry`, what `FrontendServer` holds.

The OTel SDK set-up from `OTEL_*` and the /metrics server come from `shared_runtime.telemetry` (shared with the
engine).
"""
