"""No request lost to an engine: a request whose engine dies (kill -9) or drains (SIGTERM) goes on on another
engine, and its client cannot tell - its text, tokens, logprobs, finish reason and usage equal those of
the same request on an undisturbed engine. Through the gRPC API and the OpenAI API (SSE and not).

Each test runs its workload twice on the same frontend and engines: once undisturbed (the oracle), then
again with an engine killed (or drained) mid-stream. Prefix caching is off so that both runs compute the
same things (usage's cached-token count would otherwise differ between a cold and a warm run)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

from frontend_svc.client import generate_request
from tests.support import Service, free_port, wait_until

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ("--dtype", "float32", "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(64 << 20),
                "--metrics-port", "0", "--no-enable-prefix-caching")
MAX_TOKENS = 160
REGEX = "[a-z]{2,6}( [a-z]{2,6}){8,24}"


def engine(model: Path, port: int, log_dir: Path, *flags: str) -> Service:
    return Service("engine", [sys.executable, "-m", "engine_svc.cli", "--model", str(model), "--host", "127.0.0.1",
                              "--port", str(port), *ENGINE_FLAGS, *flags], port, log_dir)


def frontend(model: Path, engine_ports: list[int], log_dir: Path, *flags: str) -> tuple[Service, int]:
    http_port = free_port()
    port = free_port()
    argv = [sys.executable, "-m", "frontend_svc.cli", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--engine", ",".join(f"127.0.0.1:{p}" for p in engine_ports),
            "--http-port", str(http_port), "--metrics-port", "0", "--routing", "least-load",
            "--max-concurrent-requests", "128", *flags]
    return Service("frontend", argv, port, log_dir), http_port


class Fleet:
    """Engines and one frontend; `running(i)` reads engine i's load."""

    def __init__(self, model: Path, log_dir: Path, engines: int = 2, *, frontend_flags: tuple[str, ...] = (),
                 engine_flags: tuple[str, ...] = ()) -> None:
        self.model, self.log_dir, self.engine_flags = model, log_dir, engine_flags
        self.engines = [engine(model, free_port(), log_dir, *engine_flags).start() for _ in range(engines)]
        self.frontend, self.http_port = frontend(model, [e.port for e in self.engines], log_dir, *frontend_flags)
        self.frontend.start()
        for e in self.engines:
            e.wait_serving()
        self.frontend.wait_serving()
        self.channel = grpc.insecure_channel(self.frontend.address)
        self.api = pb_grpc.GenerationServiceStub(self.channel)
        wait_until(lambda: self.ready_engines() == engines, 30, "the frontend sees every engine")

    def ready_engines(self) -> int:
        return int(self.api.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_ready_engines)

    def running(self, i: int) -> int:
        with grpc.insecure_channel(self.engines[i].address) as channel:
            load = epb_grpc.EngineCoreServiceStub(channel).GetLoad(epb.GetLoadRequest(), timeout=5)
        return int(load.num_running + load.num_waiting)

    def add_engine(self, port: int) -> Service:
        return engine(self.model, port, self.log_dir, *self.engine_flags).start().wait_serving()

    def close(self) -> None:
        self.channel.close()
        self.frontend.stop()
        for e in self.engines:
            e.stop()


@pytest.fixture
def fleet(make_model: Any, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(make_model("llama"), tmp_path)
    try:
        yield f
    finally:
        f.close()


def workload(vocab: int) -> list[pb.GenerateRequest]:
    """32 requests of every kind the issue names: greedy, seeded sampling, stop strings, logprobs, a regex
    constraint, n = 2; long enough (ignore_eos) to be mid-stream when an engine goes."""
    requests = []
    for i in range(32):
        kind = i % 6
        prompt = [3 + (i * 37 + k * 11) % (vocab - 3) for k in range(12 + i % 7)]
        options: dict[str, Any] = {"max_tokens": MAX_TOKENS - 20 * (i % 3), "ignore_eos": True}
        if kind == 0:
            options.update(temperature=0.0)
        elif kind == 1:
            options.update(temperature=0.9, top_p=0.95, seed=1000 + i, presence_penalty=0.5)
        elif kind == 2:
            options.update(temperature=0.0, stop=["qq", "zz"], logprobs=2)
        elif kind == 3:
            options.update(temperature=0.7, seed=7 + i, n=2, logprobs=1, frequency_penalty=0.3)
        elif kind == 4:
            options.update(temperature=0.0, max_tokens=60, ignore_eos=False,
                           structured_outputs=pb.StructuredOutputs(regex=REGEX))
        else:
            options.update(temperature=1.0, seed=99 + i, min_tokens=30, repetition_penalty=1.2)
        requests.append(generate_request(token_ids=prompt, **options))
    return requests


def outcome(responses: Iterator[pb.GenerateResponse]) -> dict[int, dict[str, Any]]:
    """What a client can see of one call: per completion, text, tokens, logprobs, finish, usage."""
    out: dict[int, dict[str, Any]] = {}
    for r in responses:
        entry = out.setdefault(r.index, {"text": "", "ids": [], "logprobs": [], "finish": 0, "stop": None,
                                         "usage": None})
        entry["text"] += r.text
        entry["ids"] += list(r.token_ids)
        entry["logprobs"] += [(lp.token_id, lp.logprob, [t.token_id for t in lp.top_logprobs])
                              for lp in r.logprobs]
        if r.finish_reason:
            entry["finish"] = r.finish_reason
            entry["stop"] = r.stop_string or r.stop_token_id or None
            entry["usage"] = (r.usage.prompt_tokens, r.usage.completion_tokens)
    return out


def assert_same(disturbed: list[dict[int, dict[str, Any]]], undisturbed: list[dict[int, dict[str, Any]]]) -> None:
    """Everything equal, logprobs within 1e-4 (the float32 oracle's tolerance: a batch of another shape
    rounds differently, disturbed or not)."""
    assert len(disturbed) == len(undisturbed)
    for i, (got, want) in enumerate(zip(disturbed, undisturbed)):
        assert got.keys() == want.keys(), i
        for k in want:
            a, b = dict(got[k]), dict(want[k])
            lp_a, lp_b = a.pop("logprobs"), b.pop("logprobs")
            assert a == b, (i, k)
            assert [(t, top) for t, _, top in lp_a] == [(t, top) for t, _, top in lp_b], (i, k)
            assert max((abs(x - y) for (_, x, _), (_, y, _) in zip(lp_a, lp_b)), default=0.0) < 1e-4, (i, k)


def run_all(fleet: Fleet, requests: list[pb.GenerateRequest],
            midway: Callable[[], None] | None = None) -> list[dict[int, dict[str, Any]]]:
    """Every request streamed at once; `midway` runs once every stream has its first response."""
    started = threading.Barrier(len(requests) + 1)

    def one(request: pb.GenerateRequest) -> dict[int, dict[str, Any]]:
        stream = fleet.api.Generate(request, timeout=120)
        first = next(stream)
        started.wait(timeout=60)

        def rest() -> Iterator[pb.GenerateResponse]:
            yield first
            yield from stream
        return outcome(rest())

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(one, r) for r in requests]
        started.wait(timeout=60)
        if midway is not None:
            midway()
        return [f.result(timeout=180) for f in futures]


def test_kill_9_of_an_engine_mid_stream_is_invisible_to_grpc_clients(fleet: Fleet) -> None:
    vocab = int(fleet.api.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).vocab_size)
    requests = workload(vocab)
    undisturbed = run_all(fleet, requests)

    victim: list[int] = []

    def kill_the_busier_engine() -> None:
        loads = [fleet.running(0), fleet.running(1)]
        victim.append(0 if loads[0] >= loads[1] else 1)
        assert loads[victim[0]] > 0, loads
        fleet.engines[victim[0]].kill(signal.SIGKILL)

    disturbed = run_all(fleet, requests, kill_the_busier_engine)
    assert not fleet.engines[victim[0]].running()
    assert_same(disturbed, undisturbed)
    assert "moved from engine" in fleet.frontend.log()


def _openai(fleet: Fleet, body: dict[str, Any]) -> dict[Any, Any]:
    """A completion's choices as the client sees them, streamed (SSE) or not: index -> (text, finish reason,
    logprob tokens, their logprobs), and "usage" -> (prompt, completion tokens)."""
    url = f"http://127.0.0.1:{fleet.http_port}/v1/completions"
    choices: dict[Any, Any] = {}

    def add(c: dict[str, Any]) -> None:
        text, finish, tokens, values = choices.get(c["index"], ("", None, [], []))
        logprobs = c.get("logprobs") or {}
        choices[c["index"]] = (text + c["text"], c["finish_reason"] or finish, tokens + (logprobs.get("tokens") or []),
                               values + (logprobs.get("token_logprobs") or []))

    if not body.get("stream"):
        answer = httpx2.post(url, json=body, timeout=120).json()
        for c in answer["choices"]:
            add(c)
        choices["usage"] = (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"])
        return choices
    with httpx2.stream("POST", url, json={**body, "stream_options": {"include_usage": True}}, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                choices["usage"] = (chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"])
            for c in chunk["choices"]:
                add(c)
    return choices


def assert_same_choices(disturbed: list[dict[Any, Any]], undisturbed: list[dict[Any, Any]]) -> None:
    """Texts, finish reasons, logprob tokens and usage equal; logprobs within 1e-4."""
    for i, (got, want) in enumerate(zip(disturbed, undisturbed, strict=True)):
        assert got.keys() == want.keys(), i
        assert got["usage"] == want["usage"], i
        for k in (k for k in want if k != "usage"):
            assert got[k][:3] == want[k][:3], (i, k)
            assert max((abs(x - y) for x, y in zip(got[k][3], want[k][3], strict=True)), default=0.0) < 1e-4


def test_kill_9_mid_stream_is_invisible_to_openai_clients_streamed_or_not(fleet: Fleet) -> None:
    vocab = int(fleet.api.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).vocab_size)
    bodies = []
    for i in range(16):
        prompt = [3 + (i * 53 + k * 7) % (vocab - 3) for k in range(10 + i % 5)]
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                "stream": i % 2 == 0}
        if i % 4 < 2:
            body.update(temperature=0.0, logprobs=2)
        else:
            body.update(temperature=0.8, seed=500 + i, n=2, stop=["qq"])
        bodies.append(body)

    def run(midway: Callable[[], None] | None) -> list[dict[Any, Any]]:
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(_openai, fleet, b) for b in bodies]
            if midway is not None:
                wait_until(lambda: fleet.running(0) + fleet.running(1) >= 8, 30, "streams running")
                midway()
            return [f.result(timeout=180) for f in futures]

    undisturbed = run(None)
    disturbed = run(lambda: fleet.engines[0 if fleet.running(0) >= fleet.running(1) else 1].kill(signal.SIGKILL))
    assert_same_choices(disturbed, undisturbed)
    assert "moved from engine" in fleet.frontend.log()


def test_a_rolling_restart_fails_no_request(make_model: Any, tmp_path: Path) -> None:
    """SIGTERM each engine in turn, its replacement started first, under a steady load: the drained engine
    finishes what it can within its grace and hands the rest back; nothing fails, outputs equal an
    undisturbed run."""
    fleet = Fleet(make_model("llama"), tmp_path, engine_flags=("--drain-grace-period", "1"))
    try:
        vocab = int(fleet.api.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).vocab_size)
        requests = workload(vocab)
        undisturbed = run_all(fleet, requests)

        def roll() -> None:
            for i in (0, 1):
                fleet.engines[i].proc.send_signal(signal.SIGTERM)
                assert fleet.engines[i].proc.wait(timeout=30) == 0  # a drain that hands back is a clean exit
                fleet.engines[i] = fleet.add_engine(fleet.engines[i].port)  # the replacement, same address
                wait_until(lambda: fleet.ready_engines() == 2, 30, "the replacement is routable")

        assert_same(run_all(fleet, requests, roll), undisturbed)
    finally:
        fleet.close()


def test_with_no_other_engine_a_request_ends_unavailable_within_the_deadline(make_model: Any, tmp_path: Path) -> None:
    fleet = Fleet(make_model("llama"), tmp_path, engines=1, frontend_flags=("--migration-timeout", "1"))
    try:
        stream = fleet.api.Generate(generate_request(token_ids=[5, 6, 7], max_tokens=2000, ignore_eos=True,
                                                     temperature=0.0), timeout=60)
        next(stream)
        fleet.engines[0].kill(signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no engine became ready within 1 s" in (caught.value.details() or "")
        assert time.monotonic() - killed < 10
    finally:
        fleet.close()


def test_with_migration_off_a_request_ends_with_its_engine(make_model: Any, tmp_path: Path) -> None:
    fleet = Fleet(make_model("llama"), tmp_path, frontend_flags=("--max-migrations", "0"))
    try:
        stream = fleet.api.Generate(generate_request(token_ids=[5, 6, 7], max_tokens=2000, ignore_eos=True,
                                                     temperature=0.0), timeout=60)
        next(stream)
        fleet.engines[0 if fleet.running(0) else 1].kill(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "moved from engine" not in fleet.frontend.log()
    finally:
        fleet.close()


def test_a_request_moves_at_most_max_migrations_times(make_model: Any, tmp_path: Path) -> None:
    """With one move allowed, a request that loses its second engine too ends with UNAVAILABLE saying so."""
    fleet = Fleet(make_model("llama"), tmp_path, frontend_flags=("--max-migrations", "1"))
    try:
        stream = fleet.api.Generate(generate_request(token_ids=[5, 6, 7], max_tokens=2000, ignore_eos=True,
                                                     temperature=0.0), timeout=60)
        next(stream)
        first = 0 if fleet.running(0) else 1
        fleet.engines[first].kill(signal.SIGKILL)
        wait_until(lambda: fleet.running(1 - first) > 0, 30, "the request runs on the other engine")
        fleet.engines[1 - first].kill(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "moved 1 times already" in (caught.value.details() or "")
    finally:
        fleet.close()


@pytest.mark.parametrize("parallel", [("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "2")],
                         ids=["tp2", "pp2"])
def test_a_tp_engine_whose_worker_dies_exits_non_zero_and_its_streams_move(make_model: Any, tmp_path: Path,
                                                                           parallel: tuple[str, str]) -> None:
    """kill -9 of a TP worker (of the last pipeline stage with PP): the engine fails its requests with
    UNAVAILABLE (never RESOURCE_EXHAUSTED), which the frontend continues on the other engine, and exits
    non-zero (so Kubernetes or systemd restart it); the outputs equal an undisturbed run."""
    model = make_model("qwen2")  # one KV head: replicated across the two ranks
    tp = engine(model, free_port(), tmp_path, *parallel).start()
    other = engine(model, free_port(), tmp_path).start()
    front, _ = frontend(model, [tp.port, other.port], tmp_path)
    front.start()
    try:
        for service in (tp, other, front):
            service.wait_serving()
        channel = grpc.insecure_channel(front.address)
        api = pb_grpc.GenerationServiceStub(channel)
        wait_until(lambda: api.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_ready_engines == 2, 30,
                   "both engines ready")
        requests = [generate_request(token_ids=[5 + i, 9, 14 + i], max_tokens=120, ignore_eos=True,
                                     temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(12)]

        def run(midway: Callable[[], None] | None) -> list[dict[int, dict[str, Any]]]:
            class Api:  # what run_all reads of a fleet
                pass
            fake = Api()
            fake.api = api  # type: ignore[attr-defined]
            return run_all(fake, requests, midway)  # type: ignore[arg-type]

        undisturbed = run(None)
        workers = sorted(pid for pid in _children(tp.proc.pid)
                         if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes())
        assert len(workers) == 2, workers  # one process per rank

        disturbed = run(lambda: os.kill(workers[-1], signal.SIGKILL))
        assert_same(disturbed, undisturbed)
        assert tp.proc.wait(30) != 0, "an engine whose worker died must exit non-zero"
        assert "RESOURCE_EXHAUSTED" not in front.log()
        channel.close()
    finally:
        front.stop()
        other.stop()
        tp.kill()


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        path = task / "children"
        if path.exists():
            kids |= {int(p) for p in path.read_text().split()}
    return kids
