"""End-to-end fixtures: real engine and frontend processes on loopback ports.

`Service` wraps one child process (`python -m engine_svc.server_cli` / `python -m frontend_svc.cli`)
with its port, a health wait and a kill-on-exit guarantee. One engine + frontend pair is started per
module (`split`) and reused; tests that kill a process restart it on the same port. `cluster` (one per
session, shared by the routing, drain and Node client tests) is two engines behind two frontends that
each list both engines; a test that stops an engine calls `cluster.heal()` (or restarts it) after.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
KV_CACHE_BYTES = 32 * 1024 * 1024
ENGINE_FLAGS = ("--dtype", "float32", "--max-num-seqs", "4", "--max-waiting", "4",
                "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--metrics-port", "0")
FRONTEND_MAX_CONCURRENT = 8
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """One child process serving gRPC on 127.0.0.1:port."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.log_path = log_dir / f"{name}-{port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Service:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> Service:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.proc is not None and self.proc.poll() is None, f"{self.name} exited:\n{self.log()}"
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise AssertionError(f"{self.name} not SERVING after {timeout}s:\n{self.log()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def stop(self) -> int | None:
        """SIGTERM (drain), then SIGKILL if it lingers; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


def engine_service(model: Path, port: int, log_dir: Path, *flags: str) -> Service:
    argv = [sys.executable, "-m", "engine_svc.server_cli", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), *ENGINE_FLAGS, *flags]
    return Service("engine", argv, port, log_dir)


def frontend_service(model: Path, engine_port: int | Sequence[int], port: int, log_dir: Path,
                     *flags: str) -> Service:
    """A frontend on one engine port, or on several (`--engine a,b`)."""
    ports = [engine_port] if isinstance(engine_port, int) else list(engine_port)
    engines = ",".join(f"127.0.0.1:{p}" for p in ports)
    argv = [sys.executable, "-m", "frontend_svc.cli", "--model", str(model), "--engine",
            engines, "--host", "127.0.0.1", "--port", str(port),
            "--max-concurrent-requests", str(FRONTEND_MAX_CONCURRENT), "--drain-grace-period", "5", *flags]
    return Service("frontend", argv, port, log_dir)


class Split:
    """The module's engine + frontend pair (the engine may be replaced by a test)."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.engine = engine_service(model, free_port(), log_dir)
        self.frontend = frontend_service(model, self.engine.port, free_port(), log_dir)

    kv_cache_bytes = KV_CACHE_BYTES

    def start_frontend(self) -> Service:
        """Another frontend process on this engine (the caller stops it)."""
        return frontend_service(self.model, self.engine.port, free_port(), self.log_dir).start()

    def restart_engine(self) -> None:
        self.engine.kill()
        self.engine = engine_service(self.model, self.engine.port, self.log_dir).start()


@pytest.fixture(scope="module")
def split(make_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    model = make_model("llama")
    pair = Split(model, tmp_path_factory.mktemp("e2e-logs"))
    pair.engine.start()
    pair.frontend.start()
    try:
        pair.engine.wait_serving()
        pair.frontend.wait_serving()
        yield pair
    finally:
        pair.frontend.stop()
        pair.engine.stop()


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)


def health_status(address: str, service: str = "") -> int:
    """The health of `service` at `address`; -1 when the call fails (e.g. the process is gone)."""
    with grpc.insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status)
        except grpc.RpcError:
            return -1


# Engines roomy enough for 40 concurrent requests; a drain grace long enough that in-flight calls finish.
CLUSTER_ENGINE_FLAGS = ("--max-num-seqs", "32", "--max-waiting", "64", "--drain-grace-period", "30")
CLUSTER_FRONTEND_FLAGS = ("--max-concurrent-requests", "64")


class Cluster:
    """Two engines, and two least-load frontends that each list both engines."""

    wait_until = staticmethod(wait_until)
    health = staticmethod(health_status)
    drain_grace_s = 30.0

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.engines = [engine_service(model, free_port(), log_dir, *CLUSTER_ENGINE_FLAGS) for _ in range(2)]
        self.frontends = [self._frontend(CLUSTER_FRONTEND_FLAGS) for _ in range(2)]

    def _frontend(self, flags: Sequence[str]) -> Service:
        return frontend_service(self.model, [e.port for e in self.engines], free_port(), self.log_dir, *flags)

    def start(self) -> None:
        for service in [*self.engines, *self.frontends]:
            service.start()
        for service in [*self.engines, *self.frontends]:
            service.wait_serving()
        self.wait_frontends_see(2)

    def stop(self) -> None:
        for service in [*self.frontends, *self.engines]:
            service.stop()

    def start_frontend(self, *flags: str) -> Service:
        """Another frontend on both engines (the caller stops it)."""
        return self._frontend([*CLUSTER_FRONTEND_FLAGS, *flags]).start()

    def restart_engine(self, index: int) -> None:
        """Replace engine `index` on the same port; return once every frontend routes to it again."""
        old = self.engines[index]
        old.kill()
        self.engines[index] = engine_service(self.model, old.port, self.log_dir, *CLUSTER_ENGINE_FLAGS).start()
        self.engines[index].wait_serving()
        self.wait_frontends_see(len(self.engines))

    def heal(self) -> None:
        """Restart any engine that is not running (a test before this one stopped it)."""
        for index, engine in enumerate(self.engines):
            if engine.proc is None or engine.proc.poll() is not None:
                self.restart_engine(index)

    def load(self, index: int) -> epb.EngineLoad:
        with grpc.insecure_channel(self.engines[index].address) as channel:
            return epb_grpc.EngineCoreServiceStub(channel).GetLoad(epb.GetLoadRequest(), timeout=5)

    @staticmethod
    def model_info(frontend: Service) -> pb.GetModelInfoResponse:
        with grpc.insecure_channel(frontend.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)

    def wait_frontends_see(self, num_ready: int, frontends: Sequence[Service] = (), timeout: float = 30.0) -> None:
        """Until every frontend reports exactly `num_ready` routable engines."""
        for frontend in frontends or self.frontends:
            wait_until(lambda f=frontend: self.model_info(f).num_ready_engines == num_ready, timeout,
                       f"{frontend.address} routing to {num_ready} engine(s)")


@pytest.fixture(scope="session")
def cluster(make_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    group = Cluster(make_model("llama"), tmp_path_factory.mktemp("e2e-cluster-logs"))
    try:
        group.start()
        yield group
    finally:
        group.stop()
