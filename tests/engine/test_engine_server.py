"""`EngineServer` (engine_svc/api/server.py) in process: a tiny model, port 0, its asyncio loop on a thread.

The tests are ordinary blocking gRPC clients. `EngineStream` (tests/engine_stream.py) drives one
`Connect` call: inputs go in through a queue, a reader thread records every `EngineCoreOutputs` message.
One server serves the stream tests; health-at-start and the two drain outcomes each get their own (a
drain ends a server).

No test assumes a speed: requests that must be stopped run to the end of the context (thousands of
steps), a `StepWitness` counts the engine's steps where "how soon" matters, and `ParkingEngineServer`
holds the engine still while a test acts "during" something.
"""

from __future__ import annotations

import asyncio
import json
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

from engine_svc.api.server import EngineServer
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from shared_runtime.contract import SamplingParams
from shared_runtime.violations import ValidationError, describe
from tests.engine_stream import EngineStream, StepWitness, engine_idle, engine_load
from tests.support import health_status, wait_until

SERVICE = "tandem.engine.v1.EngineCoreService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MAX_MODEL_LEN = 2048  # the tiny model's context; the KV cache below holds four times that
IN_FLIGHT = 150  # max_tokens of requests that finish during a drain (the engine is held meanwhile)
ABORTED_WITHIN_STEPS = 300  # an abort takes effect within this many engine steps (in practice a few)


def endless(prompt_ids: list[int]) -> int:
    """max_tokens that fill the context: a request that runs until it is stopped (thousands of steps)."""
    return MAX_MODEL_LEN - len(prompt_ids)


class GatedEngineServer(EngineServer):
    """An EngineServer whose model load waits for `gate` (to observe the loading state)."""

    def __init__(self, config: EngineConfig, gate: threading.Event, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.gate = gate

    def _make_core(self) -> EngineCore:
        assert self.gate.wait(30), "the test never opened the gate"
        return super()._make_core()


class ParkingEngineServer(EngineServer):
    """An EngineServer whose busy loop parks - stops stepping, so nothing advances - before the first step
    at which `park_when(core)` holds, until `resume()`. A test can then act "while requests are in flight"
    whatever the speed of the machine."""

    def __init__(self, config: EngineConfig, park_when: Callable[[EngineCore], bool], **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.park_when = park_when
        self.parked = threading.Event()
        self._resumed = threading.Event()

    def _make_core(self) -> EngineCore:
        core = super()._make_core()
        step = core.step

        def step_or_park() -> Any:
            if not self.parked.is_set() and self.park_when(core):
                self.parked.set()
                assert self._resumed.wait(60), "the test never resumed the engine"
            return step()

        core.step = step_or_park  # type: ignore[method-assign]
        return core

    def resume(self) -> None:
        self._resumed.set()


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


def health(address: str, service: str) -> int:
    """The health status of `service`; -1 when the check fails."""
    return health_status(address, service, timeout=5)


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
    assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (1, 1)
    server.begin_drain()
    assert server.join(10) == 0  # nothing in flight: the drain ends at once


def test_unknown_health_name_is_not_found_and_reflection_lists_the_service(engine: ServerThread) -> None:
    with engine.channel() as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(reflect.ServerReflectionInfo(iter([request]), timeout=5))
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
    stream.add("abort-me", prompt(5, 40), max_tokens=endless(prompt(5, 40)))
    stream.wait(lambda: len(stream.tokens("abort-me")) >= 3, what="tokens")
    assert engine_load(engine.address).kv_cache_usage > 0
    stream.abort("abort-me")
    stream.wait_finished("abort-me")
    assert stream.last("abort-me").finish_reason == epb.FINISH_REASON_ABORT  # type: ignore[union-attr]
    wait_until(lambda: engine_idle(engine.address), what="no blocks in use after the abort")


def test_closing_a_stream_aborts_its_requests(engine: ServerThread) -> None:
    """The closed stream's requests would run ~2000 more steps; a witness request on another stream counts
    the engine's steps until they are gone: a few, because the close aborted them."""
    doomed_prompts = [prompt(6, 30), prompt(7, 30)]
    with engine.channel() as channel:
        witness = StepWitness(channel, prompt(9), max_tokens=endless(prompt(9)))
        doomed = EngineStream(channel)
        for i, ids in enumerate(doomed_prompts):
            doomed.add(f"closed-{i}", ids, max_tokens=endless(ids))
        doomed.wait(lambda: all(len(doomed.tokens(f"closed-{i}")) >= 2 for i in range(2)))
        witness.wait_stats(lambda stats: stats.num_running == 3, "all three running")
        closed_at = witness.mark()
        doomed.close()
        witness.steps_until(closed_at, lambda stats: stats.num_running == 1,
                            "the closed stream's requests aborted", within_steps=ABORTED_WITHIN_STEPS)
        assert doomed.last("closed-0") is None, "a closed stream gets nothing more"
        witness.stop()
    wait_until(lambda: engine_idle(engine.address), what="no blocks in use after the stream closed")


def test_duplicate_request_id_gets_an_error_output(engine: ServerThread, stream: EngineStream) -> None:
    stream.add("dup", prompt(8), max_tokens=endless(prompt(8)))
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
    wait_until(lambda: engine_idle(engine.address), what="idle")


def test_token_id_outside_the_vocabulary_is_invalid_argument(engine: ServerThread, stream: EngineStream,
                                                             config: EngineConfig) -> None:
    vocab = config_vocab(config)
    stream.add("bad-token", [1, 2, vocab], max_tokens=4)
    stream.wait_finished("bad-token")
    [out] = stream.outputs("bad-token")
    assert out.finish_reason == epb.FINISH_REASON_ERROR and not out.new_token_ids
    assert out.error.code == epb.ERROR_CODE_INVALID_ARGUMENT
    assert engine_idle(engine.address)


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
    """The engine is parked while both requests are in flight (so the drain begins before they can end,
    however fast the machine), then resumed: the late request is refused while they still run, and they
    run to their end."""
    server = ParkingEngineServer(config, lambda core: core.scheduler.num_running == 2, host="127.0.0.1", port=0,
                                 drain_grace_s=60)
    running = ServerThread(server).start()
    wait_until(lambda: health(running.address, "") == SERVING, 60, "SERVING")
    with running.channel() as channel:
        s = EngineStream(channel)
        s.add("old-1", prompt(30), max_tokens=IN_FLIGHT)
        s.add("old-2", prompt(31), max_tokens=IN_FLIGHT)
        assert server.parked.wait(30), "the two requests never ran together"
        running.begin_drain()
        wait_until(lambda: health(running.address, "") == health(running.address, SERVICE) == NOT_SERVING,
                   what="readiness NOT_SERVING")
        assert health(running.address, "liveness") == SERVING
        s.add("late", prompt(32), max_tokens=4)
        server.resume()
        s.wait_finished("late")
        [late] = s.outputs("late")
        assert late.error.code == epb.ERROR_CODE_UNAVAILABLE and not late.new_token_ids
        [refusal] = [m for m in s.messages if any(o.request_id == "late" for o in m.outputs)]
        assert refusal.scheduler_stats.num_running == 2, "refused while the old requests were in flight"
        assert running.join(60) == 0
        for rid in ("old-1", "old-2"):
            assert len(s.tokens(rid)) == IN_FLIGHT
            assert s.last(rid).finish_reason == epb.FINISH_REASON_LENGTH  # type: ignore[union-attr]


def test_drain_grace_expiry_fails_the_rest_with_unavailable(config: EngineConfig) -> None:
    server = ServerThread(EngineServer(config, host="127.0.0.1", port=0, drain_grace_s=0.3)).start()
    wait_until(lambda: health(server.address, "") == SERVING, 60, "SERVING")
    ids = {"endless-1": prompt(40), "endless-2": prompt(41)}
    with server.channel() as channel:
        s = EngineStream(channel)
        for rid, prompt_ids in ids.items():
            s.add(rid, prompt_ids, max_tokens=endless(prompt_ids))
        s.wait(lambda: all(s.tokens(rid) for rid in ids))
        started = time.monotonic()
        server.begin_drain()
        s.wait_finished(*ids)
        elapsed = time.monotonic() - started
        for rid, prompt_ids in ids.items():
            end = s.last(rid)
            assert end.finish_reason == epb.FINISH_REASON_ERROR  # type: ignore[union-attr]
            assert end.error.code == epb.ERROR_CODE_UNAVAILABLE  # type: ignore[union-attr]
            assert len(s.tokens(rid)) < endless(prompt_ids)
        assert elapsed >= 0.3
        assert server.join(30) == 0


# ---- defence in depth: the engine validates every request itself ------------------------------------------


def _raw_add(stream: EngineStream, request_id: str, prompt_ids: list[int], **fields: Any) -> None:
    sampling = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, **fields.pop("sampling", {})}
    request = epb.EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                    sampling_params=epb.EngineSamplingParams(**sampling), **fields)
    stream._inputs.put(epb.EngineCoreInput(add=request))


NAN, INF = float("nan"), float("inf")
BAD_ENGINE_REQUESTS = [
    ("nan-temperature", {"sampling": {"temperature": NAN}}, "temperature"),
    ("inf-top-p", {"sampling": {"top_p": INF}}, "top_p"),
    ("zero-top-p", {"sampling": {"top_p": 0.0}}, "top_p"),
    ("nan-penalty", {"sampling": {"presence_penalty": NAN}}, "presence_penalty"),
    ("huge-repetition", {"sampling": {"repetition_penalty": INF}}, "repetition_penalty"),
    ("max-tokens-0", {"sampling": {"max_tokens": 0}}, "max_tokens"),
    ("logprobs-1000", {"sampling": {"logprobs": 1000}}, "logprobs"),
    ("many-stop-ids", {"sampling": {"stop_token_ids": list(range(2000))}}, "stop token ids"),
    ("nan-arrival", {"arrival_time": NAN}, "arrival_time"),
    ("x" * 600, {}, "request id"),
    ("huge-trace", {"trace_headers": {f"k{i}": "v" for i in range(50)}}, "trace_headers"),
    ("bias-out-of-vocab", {"sampling": {"logit_bias": {10**6: 1.0}}}, "logit_bias"),
    ("bias-too-large", {"sampling": {"logit_bias": {5: 500.0}}}, "logit_bias"),  # raw: not clamped, refused
]


@pytest.mark.parametrize(("request_id", "fields", "named"), BAD_ENGINE_REQUESTS,
                         ids=[r[0][:20] for r in BAD_ENGINE_REQUESTS])
def test_invalid_requests_are_rejected_one_by_one_and_the_stream_carries_on(
        engine: ServerThread, stream: EngineStream, request_id: str, fields: dict[str, Any], named: str) -> None:
    stream.add("healthy", prompt(50), max_tokens=30)
    stream.wait(lambda: len(stream.tokens("healthy")) >= 1)
    _raw_add(stream, request_id, prompt(51), **fields)
    stream.wait_finished(request_id)
    [out] = stream.outputs(request_id)
    assert out.finish_reason == epb.FINISH_REASON_ERROR and not out.new_token_ids
    assert out.error.code == epb.ERROR_CODE_INVALID_ARGUMENT and named in out.error.message
    stream.wait_finished("healthy")
    assert len(stream.tokens("healthy")) == 30 and stream.error is None
    wait_until(lambda: engine_idle(engine.address), what="every block back")


# (raw sampling fields the frontend would refuse; the engine must refuse them with the same words)
FRONTEND_REFUSES = [
    {"top_p": 1.5},
    {"logprobs": 21, "min_p": 2.0},
    {"min_tokens": 9},  # > max_tokens (4)
    {"frequency_penalty": -3.0, "stop_token_ids": list(range(1025))},
    {"logit_bias": {5: NAN}},
]


@pytest.mark.parametrize("bad", FRONTEND_REFUSES, ids=lambda bad: ",".join(bad))
def test_the_engine_refuses_raw_requests_with_the_frontends_own_rules(stream: EngineStream,
                                                                      bad: dict[str, Any]) -> None:
    """One rule set (shared_runtime/contract.py): what the frontend refuses with field paths, the engine
    refuses too when it arrives raw over Connect, naming the same fields with the same descriptions."""
    sampling = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, **bad}
    with pytest.raises(ValidationError) as frontend:
        SamplingParams(**sampling)
    request_id = "raw-" + "-".join(bad)
    _raw_add(stream, request_id, prompt(52), sampling=bad)
    stream.wait_finished(request_id)
    [out] = stream.outputs(request_id)
    assert out.error.code == epb.ERROR_CODE_INVALID_ARGUMENT
    assert out.error.message == describe(v.with_prefix("sampling_params") for v in frontend.value.violations)
    assert sorted(frontend.value.fields) == sorted(bad)  # each bad value named once, by its field


def test_prompts_longer_than_max_model_len_are_rejected(engine: ServerThread, stream: EngineStream,
                                                        config: EngineConfig) -> None:
    _raw_add(stream, "too-long", [5] * (int(config.max_model_len or 0) + 1))
    stream.wait_finished("too-long")
    [out] = stream.outputs("too-long")
    assert out.error.code == epb.ERROR_CODE_INVALID_ARGUMENT and "max_model_len" in out.error.message


def test_max_waiting_has_a_default() -> None:
    from engine_svc.api.server import default_max_waiting
    from engine_svc.cli import build_parser

    args = build_parser().parse_args(["--model", "m"])
    assert args.max_waiting is None and args.host == "127.0.0.1"  # loopback unless told otherwise
    assert default_max_waiting(256) == 1024


def test_the_default_max_waiting_bounds_the_queue(config: EngineConfig) -> None:
    server = EngineServer(config, host="127.0.0.1", port=0)
    assert server.max_waiting == 4 * config.max_num_seqs
    assert EngineServer(config, host="127.0.0.1", port=0, max_waiting=-1).max_waiting is None


# ---- a slow writer / reader gets more, smaller messages, never one its channel refuses ------------------------


SMALL_MESSAGE_BYTES = 64 * 1024


def test_outputs_queued_behind_a_slow_stream_are_split_below_the_message_limit(config: EngineConfig) -> None:
    """Before: steps that queued while a stream could not be written were coalesced into one message of
    any size; past the limit the stream died with every request on it. Here the server's event loop is
    held for a while (as a slow frontend or a busy loop would hold the writer) while the busy loop keeps
    stepping, so ~100 steps of 8 long-id, logprobs=20 outputs queue up."""
    server = ServerThread(EngineServer(config, host="127.0.0.1", port=0,
                                       max_message_bytes=SMALL_MESSAGE_BYTES)).start()
    wait_until(lambda: health(server.address, "") == SERVING, 60, "SERVING")
    options = [("grpc.max_receive_message_length", SMALL_MESSAGE_BYTES)]
    try:
        with grpc.insecure_channel(server.address, options=options) as channel:
            s = EngineStream(channel)
            ids = [f"slow-{i}-" + "x" * 400 for i in range(8)]  # long ids: every output carries one
            for i, rid in enumerate(ids):
                s.add(rid, prompt(60 + i), max_tokens=150, logprobs=20)
            s.wait(lambda: all(s.tokens(rid) for rid in ids), what="all eight running")
            server.loop.call_soon_threadsafe(time.sleep, 2.0)  # the writer cannot run meanwhile
            wait_until(lambda: s.error is not None or all(s.last(rid) for rid in ids), 60,
                       "every request finished (or the stream failed)")
            assert s.error is None, f"the stream died: {s.error.code()}"
            assert all(len(s.tokens(rid)) == 150 for rid in ids)
            sizes = [m.ByteSize() for m in s.messages]
            assert max(sizes) <= SMALL_MESSAGE_BYTES
            assert max(sizes) > SMALL_MESSAGE_BYTES // 2, "nothing queued: the test did not test splitting"
            s.close()
    finally:
        server.begin_drain()
        assert server.join(15) == 0


def test_a_taken_port_is_an_error_not_a_shared_port(engine: ServerThread, config: EngineConfig) -> None:
    from shared_runtime.security.listen import BindError

    second = EngineServer(config, host="127.0.0.1", port=engine.server.bound_port)

    async def attempt() -> BaseException | None:
        ready = asyncio.Event()
        run = asyncio.ensure_future(second.run(ready))
        await asyncio.wait([run, asyncio.ensure_future(ready.wait())], timeout=60,
                           return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():  # it bound the port: stop it before the model loads
            second.begin_drain()
            await run
            return None
        return run.exception()

    error = asyncio.run(attempt())
    assert isinstance(error, BindError), "a second engine started on a port that is taken"
    assert "cannot listen on 127.0.0.1" in str(error)
