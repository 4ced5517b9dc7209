"""`EngineServer` (engine_svc/server.py) in process: a tiny model, port 0, its asyncio loop on a thread.

The tests are ordinary blocking gRPC clients. `EngineStream` drives one `Connect` call: inputs go in
through a queue, a reader thread records every `EngineCoreOutputs` message. One server serves the
stream tests; health-at-start and the two drain outcomes each get their own (a drain ends a server).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.server import EngineServer

SERVICE = "tandem.engine.v1.EngineCoreService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = 1000  # max_tokens of a request that runs until it is stopped
IN_FLIGHT = 150  # max_tokens of requests that must outlive a few RPCs (about a second here)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.01)


class GatedEngineServer(EngineServer):
    """An EngineServer whose model load waits for `gate` (to observe the loading state)."""

    def __init__(self, config: EngineConfig, gate: threading.Event, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.gate = gate

    def _make_core(self) -> EngineCore:
        assert self.gate.wait(30), "the test never opened the gate"
        return super()._make_core()


class ServerThread:
    """Runs `server.run()` on a fresh event loop in a daemon thread; `exit_code` once it returns."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.exit_code: int | None = None
        self._listening = threading.Event()
        self._thread = threading.Thread(target=self._main, name="engine-server-test", daemon=True)

    def _main(self) -> None:
        self.exit_code = self.loop.run_until_complete(self._run())

    async def _run(self) -> int:
        ready = asyncio.Event()
        run = asyncio.ensure_future(self.server.run(ready))
        await asyncio.wait([run, asyncio.ensure_future(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
        self._listening.set()
        return await run

    def start(self) -> ServerThread:
        self._thread.start()
        assert self._listening.wait(30), "the server never started listening"
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.bound_port}"

    def begin_drain(self) -> None:
        self.loop.call_soon_threadsafe(self.server.begin_drain)

    def join(self, timeout: float) -> int | None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the server did not exit within {timeout}s"
        return self.exit_code

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)


class EngineStream:
    """One `Connect` call: `add`/`abort` send inputs; every output message is kept in `messages`."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._inputs: queue.SimpleQueue[epb.EngineCoreInput | None] = queue.SimpleQueue()
        self.call = epb_grpc.EngineCoreServiceStub(channel).Connect(iter(self._inputs.get, None))
        self.messages: list[epb.EngineCoreOutputs] = []
        self.error: grpc.RpcError | None = None
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self.call:
                with self._changed:
                    self.messages.append(message)
                    self._changed.notify_all()
        except grpc.RpcError as error:
            self.error = error

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8, **params: Any) -> None:
        sampling = epb.EngineSamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
        request = epb.EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling)
        self._inputs.put(epb.EngineCoreInput(add=request))

    def abort(self, *request_ids: str) -> None:
        self._inputs.put(epb.EngineCoreInput(abort=epb.AbortRequests(request_ids=list(request_ids))))

    def close(self) -> None:
        self.call.cancel()
        self._inputs.put(None)

    def outputs(self, request_id: str | None = None) -> list[epb.EngineCoreOutput]:
        with self._changed:
            return [o for m in self.messages for o in m.outputs if request_id in (None, o.request_id)]

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs(request_id) for t in o.new_token_ids]

    def last(self, request_id: str) -> epb.EngineCoreOutput | None:
        """The request's final output (finish_reason set), or None while it runs."""
        ends = [o for o in self.outputs(request_id) if o.finish_reason]
        return ends[-1] if ends else None

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "outputs") -> None:
        with self._changed:
            assert self._changed.wait_for(predicate, timeout), f"{what} not seen within {timeout}s"

    def wait_finished(self, *request_ids: str, timeout: float = 10.0) -> None:
        self.wait(lambda: all(self.last(r) is not None for r in request_ids), timeout, f"{request_ids} finished")


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def load(address: str) -> epb.EngineLoad:
    with grpc.insecure_channel(address) as channel:
        return epb_grpc.EngineCoreServiceStub(channel).GetLoad(epb.GetLoadRequest(), timeout=5)


def is_idle(address: str) -> bool:
    now = load(address)
    return (now.num_running, now.num_waiting, now.kv_cache_usage) == (0, 0, 0) \
        and now.num_free_blocks == now.num_total_blocks > 0


def config_vocab(config: EngineConfig) -> int:
    return int(json.loads((Path(config.model) / "config.json").read_text())["vocab_size"])


def prompt(seed: int, length: int = 10) -> list[int]:
    return [(seed * 31 + i * 7) % 400 + 3 for i in range(length)]


@pytest.fixture(scope="module")
def config(llama_dir: Path) -> EngineConfig:
    return EngineConfig.create(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=8,
                               kv_cache_memory_bytes=4 << 20)


@pytest.fixture(scope="module")
def engine(config: EngineConfig) -> Iterator[ServerThread]:
    running = ServerThread(EngineServer(config, host="127.0.0.1", port=0)).start()
    wait_until(lambda: health(running.address, "") == SERVING, 60, "engine SERVING")
    yield running
    running.begin_drain()
    assert running.join(15) == 0


@pytest.fixture()
def stream(engine: ServerThread) -> Iterator[EngineStream]:
    with engine.channel() as channel:
        opened = EngineStream(channel)
        yield opened
        opened.close()


# ---- health, reflection, info ------------------------------------------------------------------------


def test_health_is_not_serving_until_the_model_is_loaded(config: EngineConfig) -> None:
    gate = threading.Event()
    server = ServerThread(GatedEngineServer(config, gate, host="127.0.0.1", port=0)).start()
    try:
        assert health(server.address, "") == NOT_SERVING
        assert health(server.address, SERVICE) == NOT_SERVING
        assert health(server.address, "liveness") == SERVING
        with server.channel() as channel:
            with pytest.raises(grpc.RpcError) as info:
                epb_grpc.EngineCoreServiceStub(channel).GetEngineInfo(epb.GetEngineInfoRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            early = EngineStream(channel)
            wait_until(lambda: early.error is not None, what="Connect refused while loading")
            assert early.error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[union-attr]
    finally:
        gate.set()
    wait_until(lambda: health(server.address, "") == health(server.address, SERVICE) == SERVING, 60,
               "SERVING once loaded")
    with server.channel() as channel:
        info = epb_grpc.EngineCoreServiceStub(channel).GetEngineInfo(epb.GetEngineInfoRequest(), timeout=5)
    assert info.vocab_size == config_vocab(config) and info.num_blocks > 0 and info.engine_id
    server.begin_drain()
    assert server.join(10) == 0  # nothing in flight: the drain ends at once


def test_unknown_health_name_is_not_found_and_reflection_lists_the_service(engine: ServerThread) -> None:
    with engine.channel() as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request])))
    names = {s.name for s in answer.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


# ---- Connect --------------------------------------------------------------------------------------------


def test_outputs_come_one_message_per_step_not_per_token(stream: EngineStream) -> None:
    ids = [f"batch-{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        stream.add(rid, prompt(i), max_tokens=8)
    stream.wait_finished(*ids)
    assert [len(stream.tokens(r)) for r in ids] == [8] * 4
    assert all(stream.last(r).finish_reason == epb.FINISH_REASON_LENGTH for r in ids)  # type: ignore[union-attr]
    sizes = [len(m.outputs) for m in stream.messages]
    assert max(sizes) >= 4, f"outputs were not batched: {sizes}"
    assert len(sizes) <= 8 + 3, f"more messages than steps: {sizes}"  # 4 adds may land in 4 steps
    assert all(m.HasField("scheduler_stats") for m in stream.messages)


def test_abort_ends_the_request_and_frees_its_blocks(engine: ServerThread, stream: EngineStream) -> None:
    stream.add("abort-me", prompt(5, 40), max_tokens=LONG)
    stream.wait(lambda: len(stream.tokens("abort-me")) >= 3, what="tokens")
    assert load(engine.address).kv_cache_usage > 0
    stream.abort("abort-me")
    stream.wait_finished("abort-me")
    assert stream.last("abort-me").finish_reason == epb.FINISH_REASON_ABORT  # type: ignore[union-attr]
    wait_until(lambda: is_idle(engine.address), what="no blocks in use after the abort")


def test_closing_a_stream_aborts_its_requests(engine: ServerThread) -> None:
    with engine.channel() as channel:
        doomed = EngineStream(channel)
        doomed.add("closed-1", prompt(6, 30), max_tokens=LONG)
        doomed.add("closed-2", prompt(7, 30), max_tokens=LONG)
        doomed.wait(lambda: len(doomed.tokens("closed-1")) >= 2 and len(doomed.tokens("closed-2")) >= 2)
        assert load(engine.address).num_running == 2
        doomed.close()
    wait_until(lambda: is_idle(engine.address), what="no blocks in use after the stream closed")


def test_duplicate_request_id_gets_an_error_output(engine: ServerThread, stream: EngineStream) -> None:
    stream.add("dup", prompt(8), max_tokens=LONG)
    stream.wait(lambda: len(stream.tokens("dup")) >= 1)
    stream.add("dup", prompt(9), max_tokens=4)
    stream.wait(lambda: any(o.HasField("error") for o in stream.outputs("dup")), what="duplicate rejected")
    [error] = [o for o in stream.outputs("dup") if o.HasField("error")]
    assert error.error.code == epb.ERROR_CODE_INVALID_ARGUMENT and "duplicate" in error.error.message
    assert error.finish_reason == epb.FINISH_REASON_ERROR
    count = len(stream.tokens("dup"))
    stream.wait(lambda: len(stream.tokens("dup")) > count, what="the original still running")
    stream.abort("dup")
    stream.wait(lambda: stream.last("dup").finish_reason == epb.FINISH_REASON_ABORT)  # type: ignore[union-attr]
    wait_until(lambda: is_idle(engine.address), what="idle")


def test_token_id_outside_the_vocabulary_is_invalid_argument(engine: ServerThread, stream: EngineStream,
                                                             config: EngineConfig) -> None:
    vocab = config_vocab(config)
    stream.add("bad-token", [1, 2, vocab], max_tokens=4)
    stream.wait_finished("bad-token")
    [out] = stream.outputs("bad-token")
    assert out.finish_reason == epb.FINISH_REASON_ERROR and not out.new_token_ids
    assert out.error.code == epb.ERROR_CODE_INVALID_ARGUMENT
    assert is_idle(engine.address)


def test_two_streams_get_only_their_own_outputs(engine: ServerThread) -> None:
    with engine.channel() as channel:
        first, second = EngineStream(channel), EngineStream(channel)
        try:
            for i, (s, tag) in enumerate([(first, "a"), (second, "b"), (first, "c"), (second, "d")]):
                s.add(f"own-{tag}", prompt(20 + i), max_tokens=6)
            first.wait_finished("own-a", "own-c")
            second.wait_finished("own-b", "own-d")
            assert {o.request_id for o in first.outputs()} == {"own-a", "own-c"}
            assert {o.request_id for o in second.outputs()} == {"own-b", "own-d"}
            assert all(len(s.tokens(f"own-{t}")) == 6 for s, t in [(first, "a"), (first, "c"), (second, "b"),
                                                                    (second, "d")])
        finally:
            first.close()
            second.close()


# ---- drain -------------------------------------------------------------------------------------------------


def test_drain_refuses_new_requests_finishes_in_flight_and_exits_zero(config: EngineConfig) -> None:
    server = ServerThread(EngineServer(config, host="127.0.0.1", port=0, drain_grace_s=30)).start()
    wait_until(lambda: health(server.address, "") == SERVING, 60, "SERVING")
    with server.channel() as channel:
        s = EngineStream(channel)
        s.add("old-1", prompt(30), max_tokens=IN_FLIGHT)
        s.add("old-2", prompt(31), max_tokens=IN_FLIGHT)
        s.wait(lambda: bool(s.tokens("old-1")) and bool(s.tokens("old-2")))
        started = time.monotonic()
        server.begin_drain()
        wait_until(lambda: health(server.address, "") == health(server.address, SERVICE) == NOT_SERVING,
                   what="readiness NOT_SERVING")
        assert health(server.address, "liveness") == SERVING
        s.add("late", prompt(32), max_tokens=4)
        s.wait_finished("late")
        [late] = s.outputs("late")
        assert late.error.code == epb.ERROR_CODE_UNAVAILABLE and not late.new_token_ids
        assert s.last("old-1") is None, "in-flight requests ended before the drain was tested"
        assert server.join(30) == 0
        for rid in ("old-1", "old-2"):
            assert len(s.tokens(rid)) == IN_FLIGHT
            assert s.last(rid).finish_reason == epb.FINISH_REASON_LENGTH  # type: ignore[union-attr]
        assert time.monotonic() - started < 30


def test_drain_grace_expiry_fails_the_rest_with_unavailable(config: EngineConfig) -> None:
    server = ServerThread(EngineServer(config, host="127.0.0.1", port=0, drain_grace_s=0.3)).start()
    wait_until(lambda: health(server.address, "") == SERVING, 60, "SERVING")
    with server.channel() as channel:
        s = EngineStream(channel)
        s.add("endless-1", prompt(40), max_tokens=LONG)
        s.add("endless-2", prompt(41), max_tokens=LONG)
        s.wait(lambda: bool(s.tokens("endless-1")) and bool(s.tokens("endless-2")))
        started = time.monotonic()
        server.begin_drain()
        s.wait_finished("endless-1", "endless-2")
        elapsed = time.monotonic() - started
        for rid in ("endless-1", "endless-2"):
            end = s.last(rid)
            assert end.finish_reason == epb.FINISH_REASON_ERROR  # type: ignore[union-attr]
            assert end.error.code == epb.ERROR_CODE_UNAVAILABLE  # type: ignore[union-attr]
            assert len(s.tokens(rid)) < LONG
        assert 0.3 <= elapsed < 5
        assert server.join(10) == 0
