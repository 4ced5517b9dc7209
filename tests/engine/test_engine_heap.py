"""The engine server settles its heap once its engine is built (shared_runtime/heap.py), as the frontend
does after start-up: measured, one full collection of start-up's ~640k objects took 207 ms, a pause of
every stream's step. Only the CLI asks for it: a frozen object is never collected, which an embedding
process (the tests' in-process servers) may not want."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

import engine_svc.api.server
import engine_svc.telemetry
from engine_svc import cli as server_cli
from engine_svc.config import EngineConfig


@pytest.mark.parametrize("when_ready", [True, False])
def test_on_ready_settles_the_heap_only_when_asked(monkeypatch, llama_dir, when_ready: bool) -> None:
    calls: list[object] = []
    monkeypatch.setattr(engine_svc.api.server, "settle_heap", lambda: calls.append("settle"))
    config = EngineConfig.create(model=str(llama_dir), device="cpu", dtype="float32")
    server = engine_svc.api.server.EngineServer(config, host="127.0.0.1", port=0, settle_heap_when_ready=when_ready)
    server.servicer = SimpleNamespace(core=None)  # type: ignore[assignment]
    monkeypatch.setattr(server, "_set_serving", lambda on: calls.append(("serving", on)))
    server._on_ready(SimpleNamespace(num_blocks=4, kv_connector=None, loras=None))  # type: ignore[arg-type]
    assert calls == (["settle", ("serving", True)] if when_ready else [("serving", True)])


def test_the_engine_cli_asks_for_it(monkeypatch, llama_dir) -> None:
    built: dict[str, Any] = {}

    class Server:
        def __init__(self, config: Any, **kwargs: Any) -> None:
            built.update(kwargs)
            self.begin_drain = self.force_exit = self.reload_credentials = lambda *a: None

        async def run(self) -> int:
            return 0

    class Telemetry:
        @staticmethod
        def from_env(*args: Any) -> Telemetry:
            return Telemetry()

        def shutdown(self) -> None: ...

    monkeypatch.setattr(engine_svc.api.server, "EngineServer", Server)
    monkeypatch.setattr(engine_svc.telemetry, "EngineTelemetry", Telemetry)
    args = argparse.Namespace(metrics_port=0, host="127.0.0.1", port=0, max_waiting=None, drain_grace_period=1.0,
                              health_port=0, max_message_bytes=1 << 20, enable_kv_cache_events=False,
                              kv_events_buffer=8, max_kv_event_subscribers=128, max_tokenizer_downloads=32,
                              disable_log_stats=False, log_stats_interval=10.0)
    config = EngineConfig.create(model=str(llama_dir), device="cpu", dtype="float32")
    assert asyncio.run(server_cli._serve(config, args, None, (None, None))) == 0
    assert built["settle_heap_when_ready"] is True
