"""Observability fixtures: an engine server and a frontend server in one asyncio loop (in-process),
each with its own TracerProvider exporting to one shared in-memory exporter, and each with its own
Prometheus registry served over HTTP on a free port.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

KV_CACHE_BYTES = 16 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return False
    return bool(status == health_pb2.HealthCheckResponse.SERVING)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def provider(name: str, exporter: InMemorySpanExporter) -> TracerProvider:
    p = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    p.add_span_processor(SimpleSpanProcessor(exporter))
    return p


@dataclass
class Stack:
    frontend_port: int
    engine_metrics_port: int
    frontend_metrics_port: int
    exporter: InMemorySpanExporter
    engine_server: Any
    frontend: Any


@pytest.fixture(scope="package")
def stack(make_model: Any) -> Iterator[Stack]:
    from engine_svc.config import config_from_args
    from engine_svc.server import EngineServer
    from engine_svc.server_cli import build_parser
    from engine_svc.telemetry import EngineMetrics, EngineTelemetry, RequestSpans
    from frontend_svc.config import FrontendConfig
    from frontend_svc.server import FrontendServer
    from frontend_svc.telemetry.export import serve_metrics
    from frontend_svc.telemetry.metrics import FrontendMetrics
    from frontend_svc.telemetry.service import FrontendTelemetry

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

    async def start_engine() -> None:
        asyncio.get_running_loop().create_task(engine.run(ready))
        await ready.wait()

    loop.run(start_engine())
    wait_for(lambda: serving(engine.bound_port), 120)
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
    wait_for(lambda: serving(frontend.bound_port))
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
        loop.loop.call_soon_threadsafe(engine._done.set)
        time.sleep(0.5)
        loop.close()
