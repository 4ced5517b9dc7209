"""Frontend observability: OpenTelemetry spans and Prometheus metrics for `tandem.v1.GenerationService`.

- `export.py`: the OTel SDK set-up from `OTEL_*` and the /metrics HTTP server (also used by the engine).
- `tracing.py`: the Generate call's span and the headers handed to the engine.
- `metrics.py`: the frontend's Prometheus series.
- `call.py`: `GenerateCall`, one call's span + metrics from arrival to end.
- `service.py`: `FrontendTelemetry`, what `FrontendServer` holds.

Kept import-light (nothing is imported here) so the engine can use `export.py` alone.
"""
