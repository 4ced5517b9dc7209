"""Observability fixtures: an engine server and a frontend server in one asyncio loop (in-process),
each with its own TracerProvider exporting to one shared in-memory exporter, and each with its own
Prometheus registry served over HTTP on a free port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.observability.support import KV_CACHE_BYTES, Stack, provider
from tests.support import LoopThread, free_port, is_serving, wait_until


@pytest.fixture(scope="package")
def stack(make_model: Any) -> Iterator[Stack]:
    from engine_svc.api.server import EngineServer
    from engine_svc.cli import build_parser
    from engine_svc.config import config_from_args
    from engine_svc.telemetry import EngineMetrics, EngineTelemetry, RequestSpans
    from frontend_svc.config import FrontendConfig
    from frontend_svc.server import FrontendServer
    from frontend_svc.telemetry.metrics import FrontendMetrics
    from frontend_svc.telemetry.service import FrontendTelemetry
    from shared_runtime.telemetry import serve_metrics

    model = make_model("llama")
    exporter = InMemorySpanExporter()
    loop = LoopThread()
    args = build_parser().parse_args(["--model", str(model), "--dtype", "float32", "--max-num-seqs", "4",
                                      "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)])
    config = config_from_args(args)
    engine_tp = provider("tandem-engine", exporter)
    engine_metrics = EngineMetrics(config.model_name)
    engine_telemetry = EngineTelemetry(RequestSpans(engine_tp.get_tracer("test"), config.model_name),
                                       engine_metrics, engine_tp)
    engine = EngineServer(config, host="127.0.0.1", port=0, telemetry=engine_telemetry)
    ready = asyncio.Event()

    async def start_engine() -> asyncio.Task[int]:
        task = asyncio.get_running_loop().create_task(engine.run(ready))
        await ready.wait()
        return task

    async def stop_engine(task: asyncio.Task[int]) -> None:
        engine._done.set()
        await task

    engine_task = loop.run(start_engine())
    wait_until(lambda: is_serving(f"127.0.0.1:{engine.bound_port}"), 120, "the engine SERVING")
    fe_config = FrontendConfig(model=str(model), engines=(f"127.0.0.1:{engine.bound_port}",),
                               host="127.0.0.1", port=0, metrics_port=0)
    frontend_tp = provider("tandem-frontend", exporter)
    frontend_metrics = FrontendMetrics(fe_config.model_name)
    fe_telemetry = FrontendTelemetry(fe_config.model_name, frontend_tp.get_tracer("test"), frontend_metrics,
                                     frontend_tp)

    async def start_frontend() -> Any:
        server = FrontendServer(fe_config, telemetry=fe_telemetry)
        await server.start()
        return server

    frontend = loop.run(start_frontend())
    wait_until(lambda: is_serving(f"127.0.0.1:{frontend.bound_port}"), 30, "the frontend SERVING")
    engine_http = serve_metrics(engine_metrics.registry, free_port(), "127.0.0.1")
    frontend_http = serve_metrics(frontend_metrics.registry, free_port(), "127.0.0.1")
    try:
        yield Stack(frontend.bound_port, engine_http.server_port, frontend_http.server_port, exporter,
                    engine, frontend)
    finally:
        for http in (engine_http, frontend_http):
            http.shutdown()
            http.server_close()
        loop.run(frontend.stop())
        loop.run(stop_engine(engine_task))
        loop.close()
