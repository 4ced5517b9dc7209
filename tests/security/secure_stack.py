"""In-process stacks for the security tests: a fake engine and a real `FrontendServer` on one asyncio loop
in a background thread, talking over real loopback sockets; the tests are blocking gRPC clients.

The fake engine (tests/fake_engine.py) streams each request's prompt tokens back, one per step (every
`step_s`), until `max_tokens` (unset: forever), and records how many requests it had running at once. `Victim` is a
stream read on its own thread that records when each response arrived, to measure stalls.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from frontend_svc.config import FrontendConfig
from frontend_svc.server import FrontendServer
from tests.fake_engine import FakeEngine, start_fake_engine
from tests.support import LoopThread, max_gap, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING


class Stack:
    """A fake engine and a frontend (any FrontendConfig overrides) on `loop`; `close()` stops both."""

    def __init__(self, loop: LoopThread, tokenizer: Any, model_dir: Any, *, max_model_len: int = 256,
                 step_s: float = 0.005, engine: tuple[grpc.aio.Server, int] | None = None,
                 telemetry: Any = None, **overrides: Any) -> None:
        self.loop = loop
        self.fake = FakeEngine(tokenizer.vocab_size, max_model_len, step_s, default_max_tokens=None)
        self.engine_server, engine_port = engine or loop.run(start_fake_engine(self.fake))
        config = FrontendConfig(model=str(model_dir), engines=(f"127.0.0.1:{engine_port}",), host="127.0.0.1",
                                port=0, max_model_len=max_model_len, **overrides)

        async def start() -> FrontendServer:
            server = FrontendServer(config, tokenizer=tokenizer, telemetry=telemetry)
            await server.start()
            return server

        self.frontend: FrontendServer = loop.run(start())
        self.address = f"127.0.0.1:{self.frontend.bound_port}"

    def wait_serving(self, channel: grpc.Channel | None = None, timeout: float = 15.0) -> None:
        own = channel is None
        channel = channel or grpc.insecure_channel(self.address)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            wait_until(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING, timeout,
                       "the frontend SERVING", retry_on=(grpc.RpcError,))
        finally:
            if own:
                channel.close()

    def close(self) -> None:
        self.loop.run(self.frontend.stop())
        self.loop.run(self.engine_server.stop(None))


class Victim:
    """A long Generate stream read on its own thread; `arrivals` are the monotonic times of its responses."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.arrivals: list[float] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for _ in self.stream:
                self.arrivals.append(time.monotonic())
        except grpc.RpcError as exc:
            self.error = exc

    def wait_started(self, count: int = 5, timeout: float = 15.0) -> None:
        wait_until(lambda: len(self.arrivals) >= count, timeout, "victim stream started")

    def max_gap(self, start: float, end: float) -> float:
        return max_gap(self.arrivals, start, end)

    def stop(self) -> None:
        self.stream.cancel()
        self._thread.join(10)
