"""Torch-free runtime code that both services (frontend and engine) use.

- `contract.py` — the request contract: `SamplingParams`, `EngineCoreRequest`, the per-step outputs, and
  the one set of sampling rules (`violations()`) both services enforce; `limits.py` — every bound, once;
  `grammar_bounds.py` — the shapes of structured-output constraints that would cost too much to compile;
  `violations.py` — `FieldViolation` / `ValidationError`.
- `to_pb.py`, `from_pb.py` — contract structs <-> `tandem.engine.v1` protobuf, one module per direction.
- `security/` — TLS and certificate rotation, API keys and the engine token, listening ports, their flags,
  the guard that answers undecodable gRPC request bytes with INVALID_ARGUMENT.
- `telemetry.py` — OpenTelemetry set-up from the standard `OTEL_*` variables, the Prometheus /metrics server.
- `link.py` — the frontend <-> engine link: message-size limit and keepalive settings.
- `signals.py` — drain / force stop / reload wiring for SIGTERM, SIGINT and SIGHUP.
- `heap.py` — the garbage collector's settings for a serving process (`settle_heap()` after start-up) and
  the `GarbageWatch` that bounds what reference cycles may hold.

Nothing here imports torch, `frontend_svc` or `engine_svc` (tests/test_layering.py).
"""
