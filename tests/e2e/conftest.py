"""End-to-end fixtures: real engine and frontend processes on loopback ports.

`Service` (tests/support.py) wraps one child process (`python -m engine_svc.cli` /
`python -m frontend_svc.cli`) with its port, a health wait and a kill-on-exit guarantee. One engine +
frontend pair is started per module (`split`) and reused; a test that kills the engine restarts it on the
same port, and a test that kills a frontend starts its own. `cluster` (one per
session, shared by the routing, drain and Node client tests) is two engines behind two frontends that
each list both engines; a test that stops an engine calls `cluster.heal()` (or restarts it) after.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

from tests.support import DeadlineClient, Service, free_port, health_status, wait_until

KV_CACHE_BYTES = 32 * 1024 * 1024
ENGINE_FLAGS = ("--dtype", "float32", "--max-num-seqs", "4", "--max-waiting", "4",
                "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--metrics-port", "0")
FRONTEND_MAX_CONCURRENT = 8


def engine_service(model: Path, port: int, log_dir: Path, *flags: str) -> Service:
    argv = [sys.executable, "-m", "engine_svc.cli", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), *ENGINE_FLAGS, *flags]
    return Service("engine", argv, port, log_dir)


def assert_greedy_stream_equals_hf(client: DeadlineClient, model: Path, prompt: list[int], max_tokens: int) -> None:
    """A greedy gRPC generation through `client` has transformers' tokens, and their
    logprobs within 1e-4 (float32)."""
    from tests.engine.test_hf_exact import hf_greedy

    tokens: list[int] = []
    logprobs: list[float] = []
    for response in client.generate(token_ids=prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                    logprobs=0):
        tokens.extend(response.token_ids)
        logprobs.extend(entry.logprob for entry in response.logprobs)
    want_tokens, want_logprobs = hf_greedy(model, prompt, max_tokens)
    assert tokens == want_tokens
    assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def frontend_service(model: Path, engine_port: int | Sequence[int], port: int, log_dir: Path,
                     *flags: str) -> Service:
    """A frontend on one engine port, or on several (`--engine a,b`)."""
    ports = [engine_port] if isinstance(engine_port, int) else list(engine_port)
    engines = ",".join(f"127.0.0.1:{p}" for p in ports)
    argv = [sys.executable, "-m", "frontend_svc.cli", "--model", str(model), "--engine",
            engines, "--host", "127.0.0.1", "--port", str(port),
            "--max-concurrent-requests", str(FRONTEND_MAX_CONCURRENT), "--drain-grace-period", "5",
            "--migration-timeout", "2", *flags]
    return Service("frontend", argv, port, log_dir)


@contextlib.contextmanager
def serving_over_http(engine: Service, frontend: Service, http_port: int) -> Iterator[str]:
    """Start `engine` and `frontend` (an HTTP port `http_port`), wait until both serve and /health is 200;
    the HTTP base URL; both are stopped afterwards."""
    import httpx2

    engine.start()
    frontend.start()
    try:
        engine.wait_serving()
        frontend.wait_serving()
        url = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: httpx2.get(f"{url}/health", timeout=2).status_code == 200, 30, "/health 200")
        yield url
    finally:
        frontend.stop()
        engine.stop()


class Split:
    """The module's engine + frontend pair (the engine may be replaced by a test)."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.engine = engine_service(model, free_port(), log_dir)
        self.frontend = frontend_service(model, self.engine.port, free_port(), log_dir)

    kv_cache_bytes = KV_CACHE_BYTES

    def start_frontend(self, *flags: str) -> Service:
        """Another frontend process on this engine (the caller stops it)."""
        return frontend_service(self.model, self.engine.port, free_port(), self.log_dir, *flags).start()

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


# Engines roomy enough for 40 concurrent requests; a drain grace long enough that in-flight calls finish.
CLUSTER_ENGINE_FLAGS = ("--max-num-seqs", "32", "--max-waiting", "64", "--drain-grace-period", "30")
CLUSTER_FRONTEND_FLAGS = ("--max-concurrent-requests", "64", "--routing", "least-load")


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
