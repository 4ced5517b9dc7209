"""In-process tests of the frontend gRPC server against a fake engine (fast; no model, no torch).

Every client call has a deadline (`DeadlineClient`), so a broken server fails a test instead of hanging it.
The fake `EngineCoreService` (tests/fake_engine.py) echoes each request's prompt tokens back, one per
step, and is steered by the request's sampling seed (`SEED_REJECT`, `SEED_FAIL_LATE`, `SEED_ENDLESS`).
The frontend and the fake engine run on an asyncio loop in a background thread; the tests are ordinary blocking gRPC clients.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tandem.v1 import generation_pb2 as pb

from frontend_svc.client import TandemClient, collect, generate_request
from frontend_svc.config import FrontendConfig
from frontend_svc.engines.client import resolve_target
from frontend_svc.engines.router import Router
from frontend_svc.grpc_api.servicer import GenerationServicer
from frontend_svc.server import FrontendServer
from tests.fake_engine import SEED_ENDLESS, SEED_FAIL_LATE, SEED_REJECT, FakeEngine, start_fake_engine
from tests.support import RPC_TIMEOUT_S, DeadlineClient, LoopThread, bad_fields, rpc_error, wait_until

FAKE_MAX_MODEL_LEN = 256  # FakeEngine's default
PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests in the sun."


def make_frontend(loop: LoopThread, tokenizer: Any, model_dir: Any, engine_port: int,
                  **overrides: Any) -> FrontendServer:
    # One engine: a request whose engine goes away has nowhere to move, and ends after this short wait.
    overrides.setdefault("migration_timeout_s", 0.5)
    config = FrontendConfig(model=str(model_dir), engines=(f"127.0.0.1:{engine_port}",), host="127.0.0.1",
                            port=0, **overrides)

    async def start() -> FrontendServer:
        server = FrontendServer(config, tokenizer=tokenizer)
        await server.start()
        return server

    return loop.run(start())  # type: ignore[no-any-return]


def health_of(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[no-any-return]
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


@pytest.fixture(scope="module")
def fake(tokenizer: Any) -> FakeEngine:
    return FakeEngine(vocab_size=tokenizer.vocab_size)


@pytest.fixture(scope="module")
def stack(loop: LoopThread, fake: FakeEngine, tokenizer: Any, tiny_model_dir: Any) -> Any:
    engine, engine_port = loop.run(start_fake_engine(fake))
    frontend = make_frontend(loop, tokenizer, tiny_model_dir, engine_port, max_concurrent_requests=3,
                             max_message_bytes=64 * 1024)
    wait_until(lambda: health_of(frontend.bound_port) == health_pb2.HealthCheckResponse.SERVING)
    yield frontend, engine_port
    loop.run(frontend.stop())
    loop.run(engine.stop(None))


@pytest.fixture()
def client(stack: Any) -> Any:
    with DeadlineClient(f"127.0.0.1:{stack[0].bound_port}") as c:
        yield c


def no_running(fake: FakeEngine) -> Callable[[], bool]:
    return lambda: not fake.running


# ---- streaming ----------------------------------------------------------------------------------------


def test_generate_streams_one_response_per_step(client: TandemClient, fake: FakeEngine,
                                                tokenizer: Any) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    responses = list(client.generate(PROMPT, max_tokens=5, temperature=0, request_id="r-1"))
    assert [list(r.token_ids) for r in responses] == [[t] for t in prompt_ids[:5]]
    assert all(r.request_id == "r-1" and r.index == 0 for r in responses)
    assert [r.finish_reason for r in responses] == [0, 0, 0, 0, pb.FINISH_REASON_LENGTH]
    assert not any(r.HasField("usage") for r in responses[:-1])
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 5)
    assert "".join(r.text for r in responses) == tokenizer.decode(prompt_ids[:5])
    sent = fake.added[-1]
    assert list(sent.prompt_token_ids) == prompt_ids
    assert sent.sampling_params.temperature == 0 and sent.sampling_params.max_tokens == 5
    assert list(sent.eos_token_ids) == tokenizer.eos_token_ids


def test_unset_sampling_fields_take_documented_defaults(client: TandemClient, fake: FakeEngine) -> None:
    list(client.generate(token_ids=[5, 6, 7], max_tokens=2))
    sp = fake.added[-1].sampling_params
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.repetition_penalty == 1.0
    assert not sp.HasField("seed") and not sp.HasField("logprobs")
    out = collect(client.generate(token_ids=[5, 6, 7]))  # max_tokens unset: fill the window
    assert not fake.added[-1].sampling_params.HasField("max_tokens")
    assert out[0]["finish_reason"] == pb.FINISH_REASON_LENGTH  # the fake's own default of 8
    assert len(out[0]["token_ids"]) == 8


def test_logit_bias_reaches_the_engine_clamped(client: TandemClient, fake: FakeEngine) -> None:
    list(client.generate(token_ids=[5, 6, 7], max_tokens=2, logit_bias={5: 1e4, 9: -0.5}))
    assert dict(fake.added[-1].sampling_params.logit_bias) == {5: 100.0, 9: -0.5}
    list(client.generate(token_ids=[5, 6, 7], max_tokens=2))
    assert not fake.added[-1].sampling_params.logit_bias  # nothing sent when none is asked


def test_n_completions_are_indexed(client: TandemClient, fake: FakeEngine) -> None:
    before = len(fake.added)
    out = collect(client.generate(PROMPT, n=3, max_tokens=4, seed=7))
    assert sorted(out) == [0, 1, 2]
    assert all(o["finish_reason"] == pb.FINISH_REASON_LENGTH and len(o["token_ids"]) == 4 for o in out.values())
    added = fake.added[before:]
    assert len({a.request_id for a in added}) == 3
    assert sorted(a.sampling_params.seed for a in added) == [7, 8, 9]


def test_stop_string_is_held_back_and_aborts_the_engine_request(client: TandemClient, fake: FakeEngine) -> None:
    full = collect(client.generate(PROMPT, max_tokens=40))[0]["text"]
    stop = "lazy"
    assert stop in full
    responses = list(client.generate(PROMPT, max_tokens=40, stop=stop))
    texts = [r.text for r in responses]
    assert "".join(texts) == full[: full.index(stop)]
    assert not any(t.endswith(stop[:k]) for t in texts[:-1] for k in range(1, len(stop)) if t)
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.stop_string == stop
    wait_until(lambda: fake.added[-1].request_id in fake.aborted)  # the abort follows the last response
    wait_until(no_running(fake))


def test_stop_token_id_is_reported(client: TandemClient, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    out = collect(client.generate(token_ids=ids, max_tokens=30, stop_token_ids=[ids[3]]))[0]
    assert out["finish_reason"] == pb.FINISH_REASON_STOP and out["stop_reason"] == ids[3]
    assert out["token_ids"] == ids[:4]


def test_multibyte_text_never_splits(client: TandemClient, tokenizer: Any) -> None:
    text = "naïve café — 東京 🙂 ok"
    responses = list(client.generate(text, max_tokens=len(tokenizer.encode(text))))
    assert all("\ufffd" not in r.text for r in responses)
    assert "".join(r.text for r in responses).strip() == tokenizer.decode(tokenizer.encode(text)).strip()


# ---- errors --------------------------------------------------------------------------------------------

BAD_REQUESTS = [
    (dict(prompt=""), ["text"]),
    (dict(token_ids=[]), ["token_ids.ids"]),
    (dict(token_ids=[1, 10**6]), ["token_ids.ids"]),
    (dict(prompt="hi", temperature=math.nan), ["sampling_params.temperature"]),
    (dict(prompt="hi", temperature=-1.0), ["sampling_params.temperature"]),
    (dict(prompt="hi", top_p=1.5), ["sampling_params.top_p"]),
    (dict(prompt="hi", top_p=0.0), ["sampling_params.top_p"]),
    (dict(prompt="hi", max_tokens=0), ["sampling_params.max_tokens"]),
    (dict(prompt="hi", max_tokens=FAKE_MAX_MODEL_LEN), ["sampling_params.max_tokens"]),
    (dict(prompt="hi", logprobs=1000), ["sampling_params.logprobs"]),
    (dict(prompt="hi", stop=[""]), ["sampling_params.stop"]),
    (dict(prompt="", top_p=2.0, min_p=-1.0), ["text", "sampling_params.top_p", "sampling_params.min_p"]),
    (dict(chat=[]), ["chat.messages"]),
    (dict(prompt="hi", logit_bias={10**6: 1.0}), ["sampling_params.logit_bias"]),  # outside the vocabulary
]


@pytest.mark.parametrize(("kwargs", "fields"), BAD_REQUESTS)
def test_bad_input_is_invalid_argument_with_field_paths(client: TandemClient, kwargs: dict[str, Any],
                                                        fields: list[str]) -> None:
    prompt = kwargs.pop("prompt", None)
    error = rpc_error(lambda: list(client.generate(prompt, **kwargs)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sorted(bad_fields(error)) == sorted(fields)


def test_unset_prompt_is_invalid(client: TandemClient) -> None:
    error = rpc_error(lambda: list(client.stub.Generate(pb.GenerateRequest())))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_fields(error) == ["prompt"]


def test_engine_error_before_first_token_ends_without_responses(client: TandemClient) -> None:
    received: list[pb.GenerateResponse] = []
    error = rpc_error(lambda: received.extend(client.generate(PROMPT, seed=SEED_REJECT)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and received == []


def test_engine_error_after_tokens_ends_the_stream_with_its_code(client: TandemClient) -> None:
    """The engine fails the request with UNAVAILABLE after 2 tokens: the frontend would continue it on
    another engine, never on the one that gave it back; there is none, so the client gets UNAVAILABLE
    after the migration timeout (a short one here)."""
    received: list[pb.GenerateResponse] = []
    error = rpc_error(lambda: received.extend(client.generate(PROMPT, seed=SEED_FAIL_LATE, max_tokens=10)))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "no engine became ready" in (error.details() or "")
    assert sum(len(r.token_ids) for r in received) == 2


def test_oversize_message_is_resource_exhausted_and_server_keeps_serving(client: TandemClient) -> None:
    error = rpc_error(lambda: list(client.generate("x" * 100_000, max_tokens=1)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert collect(client.generate(PROMPT, max_tokens=2))[0]["finish_reason"] == pb.FINISH_REASON_LENGTH


def test_admission_limit_is_resource_exhausted(client: TandemClient, fake: FakeEngine) -> None:
    streams = [client.generate(PROMPT, seed=SEED_ENDLESS) for _ in range(3)]
    for stream in streams:
        next(stream)  # all three admitted and running
    error = rpc_error(lambda: list(client.generate(PROMPT, max_tokens=2)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for stream in streams:
        stream.cancel()
    wait_until(no_running(fake))
    assert collect(client.generate(PROMPT, max_tokens=2))[0]["finish_reason"] == pb.FINISH_REASON_LENGTH


# ---- cancellation ----------------------------------------------------------------------------------------


def test_client_cancel_aborts_in_engine(client: TandemClient, fake: FakeEngine) -> None:
    stream = client.generate(PROMPT, seed=SEED_ENDLESS, n=2)
    next(stream)
    ids = [a.request_id for a in fake.added[-2:]]
    assert all(rid in fake.running for rid in ids)
    stream.cancel()
    wait_until(lambda: all(rid in fake.aborted for rid in ids))
    wait_until(no_running(fake))


class SuspendedCallContext:
    """Stands in for a grpc.aio ServicerContext: records done callbacks so a test can end the RPC
    while the handler's stream is suspended at a write."""

    def __init__(self) -> None:
        self.done_callbacks: list[Callable[[Any], None]] = []
        self.written: list[pb.GenerateResponse] = []

    async def write(self, message: pb.GenerateResponse) -> None:
        """A write that never completes (a client that stopped reading)."""
        self.written.append(message)
        await asyncio.get_running_loop().create_future()

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.done_callbacks.append(callback)

    async def abort_with_status(self, status: Any) -> None:
        raise AssertionError(f"unexpected abort: {status}")

    def time_remaining(self) -> None:
        return None


def test_the_rpc_ending_releases_a_request_whose_stream_is_suspended(loop: LoopThread, stack: Any,
                                                                     fake: FakeEngine) -> None:
    """A cancel or deadline during a write can leave the handler suspended until garbage collection;
    the RPC's done callback must abort the request in the engine and free its admission slot anyway."""
    frontend = stack[0]
    context = SuspendedCallContext()
    handler = GenerationServicer(frontend).Generate(generate_request(PROMPT, seed=SEED_ENDLESS), context)
    task = loop.call(lambda: asyncio.ensure_future(handler))
    wait_until(lambda: context.written)  # the handler now sits in its first write
    assert context.written[0].token_ids
    rid = fake.added[-1].request_id
    assert rid in fake.running and frontend.admission.in_use == 1
    loop.call(lambda: [callback(None) for callback in context.done_callbacks])  # the RPC ended
    wait_until(lambda: rid in fake.aborted and rid not in fake.running)
    assert frontend.admission.in_use == 0 and not task.done()
    loop.call(task.cancel)


def test_deadline_aborts_in_engine(client: TandemClient, fake: FakeEngine) -> None:
    error = rpc_error(lambda: list(client.generate(PROMPT, seed=SEED_ENDLESS, timeout=0.3)))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: fake.added[-1].request_id in fake.aborted)
    wait_until(no_running(fake))


# ---- the other RPCs, health, reflection -------------------------------------------------------------


def test_tokenize_detokenize_model_info(client: TandemClient, tokenizer: Any) -> None:
    assert client.tokenize(PROMPT) == tokenizer.encode(PROMPT)
    assert client.tokenize(PROMPT, add_special_tokens=False) == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert client.detokenize(tokenizer.encode(PROMPT)) == tokenizer.decode(tokenizer.encode(PROMPT))
    error = rpc_error(lambda: client.detokenize([10**6]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_fields(error) == ["token_ids"]
    info = client.model_info()
    assert info.max_model_len == FAKE_MAX_MODEL_LEN  # the engine's, below config.json's
    assert info.vocab_size == tokenizer.vocab_size
    assert list(info.eos_token_ids) == tokenizer.eos_token_ids
    assert info.num_ready_engines == 1
    assert info.has_chat_template == tokenizer.has_chat_template


def test_chat_prompt(client: TandemClient, tokenizer: Any) -> None:
    chat = [{"role": "user", "content": "hello there"}]
    if not tokenizer.has_chat_template:
        error = rpc_error(lambda: list(client.generate(chat=chat, max_tokens=2)))
        assert bad_fields(error) == ["chat.messages"]
        return
    ids = client.tokenize(chat=chat)
    out = collect(client.generate(chat=chat, max_tokens=3))[0]
    assert out["token_ids"] == ids[:3]


def test_health_and_reflection(stack: Any) -> None:
    port = stack[0].bound_port
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health_of(port) == serving
    assert health_of(port, "tandem.v1.GenerationService") == serving
    assert health_of(port, "liveness") == serving
    error = rpc_error(lambda: health_of(port, "no.such.Service"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=RPC_TIMEOUT_S))
    names = {s.name for s in answer.list_services_response.service}
    assert {"tandem.v1.GenerationService", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names


# ---- engines coming and going -------------------------------------------------------------------------


def test_no_ready_engine_is_unavailable(loop: LoopThread, tokenizer: Any, tiny_model_dir: Any) -> None:
    mismatched = FakeEngine(vocab_size=tokenizer.vocab_size + 1)
    engine, engine_port = loop.run(start_fake_engine(mismatched))
    frontend = make_frontend(loop, tokenizer, tiny_model_dir, engine_port)
    try:
        time.sleep(0.3)  # it connected and refused to route to the mismatched engine
        assert health_of(frontend.bound_port) == health_pb2.HealthCheckResponse.NOT_SERVING
        with DeadlineClient(f"127.0.0.1:{frontend.bound_port}") as c:
            error = rpc_error(lambda: list(c.generate(PROMPT, max_tokens=2)))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert c.model_info().num_ready_engines == 0
        assert mismatched.added == []
    finally:
        loop.run(frontend.stop())
        loop.run(engine.stop(None))


def test_engine_loss_fails_open_streams_and_recovers(loop: LoopThread, tokenizer: Any,
                                                     tiny_model_dir: Any) -> None:
    fake = FakeEngine(vocab_size=tokenizer.vocab_size)
    engine, engine_port = loop.run(start_fake_engine(fake))
    frontend = make_frontend(loop, tokenizer, tiny_model_dir, engine_port)
    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        wait_until(lambda: health_of(frontend.bound_port) == serving)
        with DeadlineClient(f"127.0.0.1:{frontend.bound_port}") as c:
            streams = [c.generate(PROMPT, seed=SEED_ENDLESS) for _ in range(2)]
            for stream in streams:
                next(stream)
            loop.run(engine.stop(None))
            started = time.monotonic()
            for stream in streams:
                error = rpc_error(lambda s=stream: list(s))
                assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 3
            wait_until(lambda: health_of(frontend.bound_port) != serving)
            engine, _ = loop.run(start_fake_engine(fake, port=engine_port))
            wait_until(lambda: health_of(frontend.bound_port) == serving)
            assert collect(c.generate(PROMPT, max_tokens=3))[0]["finish_reason"] == pb.FINISH_REASON_LENGTH
    finally:
        loop.run(frontend.stop())
        loop.run(engine.stop(None))


def test_a_draining_engine_gets_no_new_requests(loop: LoopThread, tokenizer: Any, tiny_model_dir: Any) -> None:
    from grpc_health.v1 import health

    fake = FakeEngine(vocab_size=tokenizer.vocab_size)
    engine_health = loop.call(health.aio.HealthServicer)
    name = "tandem.engine.v1.EngineCoreService"
    engine, engine_port = loop.run(start_fake_engine(fake, health_servicer=engine_health))
    frontend = make_frontend(loop, tokenizer, tiny_model_dir, engine_port)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        loop.run(engine_health.set(name, serving))
        wait_until(lambda: health_of(frontend.bound_port) == serving)
        with DeadlineClient(f"127.0.0.1:{frontend.bound_port}") as c:
            running = c.generate(PROMPT, max_tokens=30)
            next(running)
            loop.run(engine_health.set(name, not_serving))
            wait_until(lambda: health_of(frontend.bound_port) == not_serving)
            added = len(fake.added)
            error = rpc_error(lambda: list(c.generate(PROMPT, max_tokens=2)))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and len(fake.added) == added
            assert list(running)[-1].finish_reason == pb.FINISH_REASON_LENGTH  # its own calls finish
            loop.run(engine_health.set(name, serving))
            wait_until(lambda: health_of(frontend.bound_port) == serving)
            assert collect(c.generate(PROMPT, max_tokens=2))[0]["finish_reason"] == pb.FINISH_REASON_LENGTH
    finally:
        loop.run(frontend.stop())
        loop.run(engine.stop(None))


def test_drain_lets_running_calls_finish_and_refuses_new_ones(loop: LoopThread, tokenizer: Any,
                                                              tiny_model_dir: Any) -> None:
    fake = FakeEngine(vocab_size=tokenizer.vocab_size, step_s=0.02)
    engine, engine_port = loop.run(start_fake_engine(fake))
    frontend = make_frontend(loop, tokenizer, tiny_model_dir, engine_port, drain_grace_s=0.5)
    try:
        wait_until(lambda: health_of(frontend.bound_port) == health_pb2.HealthCheckResponse.SERVING)
        with DeadlineClient(f"127.0.0.1:{frontend.bound_port}") as c:
            finishing = c.generate(PROMPT, max_tokens=10)
            endless = c.generate(PROMPT, seed=SEED_ENDLESS)
            first = next(finishing)
            next(endless)
            drained = asyncio.run_coroutine_threadsafe(frontend.drain(), loop.loop)
            wait_until(lambda: frontend.draining)
            assert health_of(frontend.bound_port) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert health_of(frontend.bound_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
            error = rpc_error(lambda: list(c.generate(PROMPT, max_tokens=2)))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(finishing)
            assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 10
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
            error = rpc_error(lambda: list(endless))  # outlived the grace period: failed by the drain
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "drained before this request finished" in error.details()
            endless_id = fake.added[-1].request_id
            # Ended in the engine, not just dropped: by the abort fail_all sends, or, when the drain's stop
            # closes the engine stream first (a loaded machine), by that stream's end, which aborts too.
            wait_until(lambda: endless_id not in fake.running, 15, "the endless request ended in the engine")
            drained.result(10)
        wait_until(no_running(fake))
    finally:
        loop.run(frontend.stop())
        loop.run(engine.stop(None))


# ---- routing and targets ----------------------------------------------------------------------------------


class _Engine:
    def __init__(self, address: str, load: int) -> None:
        self.address, self.load, self.block_size = address, load, 4


def test_least_load_picks_the_idlest_and_rotates_ties() -> None:
    router = Router("least-load")
    a, b, c = _Engine("a:1", 5), _Engine("b:1", 2), _Engine("c:1", 2)
    picks = {router.choose([a, b, c], [1, 2, 3]).address for _ in range(4)}
    assert picks == {"b:1", "c:1"}
    assert router.choose([], [1]) is None


def test_prefix_routing_is_sticky_and_yields_when_overloaded() -> None:
    router = Router("prefix")
    engines = [_Engine(f"e{i}:1", 0) for i in range(4)]
    prompts = [[i, i + 1, i + 2, i + 3, 9, 9, 9, 9] for i in range(40)]
    first = [router.choose(engines, p).address for p in prompts]
    assert [router.choose(engines, [*p, 7, 7]).address for p in prompts] == first  # same first blocks
    assert len(set(first)) > 1  # prefixes spread over engines
    target = next(e for e in engines if e.address == first[0])
    target.load = 100
    assert router.choose(engines, prompts[0]).address != first[0]
    target.load = 3
    assert router.choose(engines, prompts[0]).address == first[0]


def test_dns_targets_resolve_to_every_address() -> None:
    assert resolve_target("10.0.0.1:50051") == ["10.0.0.1:50051"]
    assert "127.0.0.1:50051" in resolve_target("dns:///localhost:50051")
    with pytest.raises(OSError):
        resolve_target("dns:///no-port")


def test_generate_request_builder_rejects_two_prompts() -> None:
    with pytest.raises(ValueError):
        generate_request("text", token_ids=[1])
    request = generate_request(token_ids=[1, 2], stop="x", temperature=0.0)
    assert list(request.sampling_params.stop) == ["x"] and request.sampling_params.HasField("temperature")


def test_tokenize_validates_a_chat_like_generate(client: TandemClient, tokenizer: Any) -> None:
    if not tokenizer.has_chat_template:
        pytest.skip("the model has no chat template")
    chat = [{"role": "user", "content": "hello there"}]
    assert client.tokenize(chat=chat) == tokenizer.apply_chat_template(chat)
    for bad in ([], [{"role": "", "content": "hi"}]):
        error = rpc_error(lambda bad=bad: client.tokenize(chat=bad))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_fields(error) == ["chat.messages"]
        error = rpc_error(lambda bad=bad: list(client.generate(chat=bad, max_tokens=2)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_fields(error) == ["chat.messages"]
