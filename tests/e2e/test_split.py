"""The split end to end: a real engine process and a real frontend process over loopback gRPC.

The oracle is the offline, in-process API (`entrypoints.LLM`): greedy (and seeded) outputs through
the split must equal it token for token. Then streaming semantics, cancellation (the engine's
`GetLoad` must return to idle with an empty KV cache), crashes of either process, bad input,
admission limits, health and reflection. The engine runs with --max-num-seqs 4 --max-waiting 4 and
the frontend with --max-concurrent-requests 8 (see conftest.py).

Requests that must be stopped run to the end of the context (thousands of steps), and a witness request
sent straight to the engine counts the engine's steps between the cancel (or kill) and the moment the
engine stops running them: a test fails when that takes more than a few hundred steps, whatever the
speed of the machine (tests/engine_stream.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc
from tandem.v1 import generation_pb2 as pb

from frontend_svc.client import collect
from tests.e2e.conftest import ENGINE_FLAGS
from tests.engine_stream import StepWitness
from tests.engine_stream import engine_idle as idle_at
from tests.engine_stream import engine_load as load_at
from tests.support import ROOT, DeadlineClient, health_status, rpc_error, wait_until

pytestmark = pytest.mark.slow

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole",
    "1 2 3 4 5",
]
GREEDY_TOKENS = 24
ENDLESS = dict(ignore_eos=True)  # max_tokens unset: to the end of the context, ~2000 steps
ABORTED_WITHIN_STEPS = 300  # an abort takes effect within this many engine steps (in practice a few)
WITNESS_PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def llm(split: Any) -> Any:
    from entrypoints.llm import LLM

    return LLM(str(split.model), dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=split.kv_cache_bytes)


@pytest.fixture(scope="module")
def second_frontend(split: Any) -> Iterator[Any]:
    """A second frontend on the same engine (used to push past the engine's limit)."""
    service = split.start_frontend()
    try:
        yield service.wait_serving()
    finally:
        service.stop()


@pytest.fixture()
def client(split: Any) -> Iterator[DeadlineClient]:
    with DeadlineClient(split.frontend.address) as c:
        yield c


def engine_load(split: Any) -> epb.EngineLoad:
    return load_at(split.engine.address)


def engine_idle(split: Any) -> bool:
    return idle_at(split.engine.address)


def routable(frontend: Any, num_engines: int = 1) -> bool:
    with DeadlineClient(frontend.address) as c:
        return c.model_info(timeout=5).num_ready_engines == num_engines


@contextlib.contextmanager
def witness(split: Any) -> Iterator[StepWitness]:
    """A request of the test's own, straight to the engine, that counts the engine's steps."""
    with grpc.insecure_channel(split.engine.address) as channel:
        info = epb_grpc.EngineCoreServiceStub(channel).GetEngineInfo(epb.GetEngineInfoRequest(), timeout=5)
        counter = StepWitness(channel, WITNESS_PROMPT, info.max_model_len - len(WITNESS_PROMPT))
        try:
            yield counter
        finally:
            counter.stop()


def details(error: grpc.RpcError) -> tuple[list[str], str]:
    """(BadRequest field paths, ErrorInfo reason) of an error's google.rpc.Status details."""
    status = rpc_status.from_call(error)
    assert status is not None, f"no status details on {error.code()}: {error.details()}"
    fields, reason = [], ""
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
    return fields, reason


# ---- exactness and streaming -----------------------------------------------------------------------------


def test_greedy_concurrent_streams_equal_the_offline_api(client: DeadlineClient, llm: Any) -> None:
    from shared_runtime.contract import SamplingParams

    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS), use_tqdm=False)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streamed = list(pool.map(
            lambda p: list(client.generate(p, temperature=0, max_tokens=GREEDY_TOKENS)), PROMPTS))
    for responses, want in zip(streamed, expected):
        completion = want.outputs[0]
        assert [t for r in responses for t in r.token_ids] == completion.token_ids
        assert "".join(r.text for r in responses) == completion.text
        if "\ufffd" not in completion.text:  # a split multi-byte character never shows as U+FFFD
            assert not any("\ufffd" in r.text for r in responses)
        assert len(responses) > 1  # streamed step by step, not in one piece
        last = responses[-1]
        assert last.finish_reason == (pb.FINISH_REASON_LENGTH if completion.finish_reason == "length"
                                      else pb.FINISH_REASON_STOP)
        assert last.usage.completion_tokens == len(completion.token_ids)
        assert last.usage.prompt_tokens == len(want.prompt_token_ids)


def test_seeded_n_completions_equal_the_offline_api(client: DeadlineClient, llm: Any) -> None:
    from shared_runtime.contract import SamplingParams

    params = dict(n=3, seed=5, temperature=1.0, max_tokens=8, ignore_eos=True)
    want = llm.generate([PROMPTS[0]], SamplingParams(**params), use_tqdm=False)[0]
    out = collect(client.generate(PROMPTS[0], **params))
    assert sorted(out) == [0, 1, 2]
    for index, completion in enumerate(want.outputs):
        assert out[index]["token_ids"] == completion.token_ids
        assert out[index]["text"] == completion.text
        assert out[index]["finish_reason"] == pb.FINISH_REASON_LENGTH


def test_logit_bias_equals_the_offline_api_and_forces_a_token(client: DeadlineClient, llm: Any) -> None:
    """The offline API is the reference here (tests/engine/test_llm_api.py holds it to transformers' logits
    plus the bias); a +100 bias forces its token even when sampling."""
    from shared_runtime.contract import SamplingParams

    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    free = llm.generate([PROMPTS[1]], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    bias = {free[0]: -100.0, free[2]: -100.0, 42: 5.0}
    want = llm.generate([PROMPTS[1]], SamplingParams(**greedy, logit_bias=bias), use_tqdm=False)[0].outputs[0]
    got = collect(client.generate(PROMPTS[1], **greedy, logit_bias=bias))[0]
    assert got["token_ids"] == want.token_ids != free and got["text"] == want.text
    forced = collect(client.generate(PROMPTS[1], temperature=1.0, seed=4, max_tokens=6, ignore_eos=True,
                                     logit_bias={42: 100.0}))[0]
    assert forced["token_ids"] == [42] * 6


def test_stop_string_is_never_sent_in_part(client: DeadlineClient) -> None:
    full = collect(client.generate(PROMPTS[2], temperature=0, max_tokens=GREEDY_TOKENS))[0]["text"]
    middle = len(full) // 2
    stop = full[middle:middle + 3]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    cut = full.index(stop)
    responses = list(client.generate(PROMPTS[2], temperature=0, max_tokens=GREEDY_TOKENS, stop=[stop]))
    assert "".join(r.text for r in responses) == full[:cut]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP and responses[-1].stop_string == stop
    included = collect(client.generate(PROMPTS[2], temperature=0, max_tokens=GREEDY_TOKENS, stop=[stop],
                                       include_stop_str_in_output=True))[0]
    assert included["text"] == full[:cut] + stop


# ---- cancellation ------------------------------------------------------------------------------------------


def ended_by(stop: Callable[[Any], object], steps: StepWitness, client: DeadlineClient, what: str) -> None:
    """Starts an endless n=2 request through `client`; `stop(its stream)` must end both completions in the
    engine within a few engine steps (counted by the witness running beside them)."""
    stream = client.generate(PROMPTS[0], n=2, **ENDLESS)
    try:
        next(stream)
        steps.wait_stats(lambda stats: stats.num_running == 3, "both completions running")
        since = steps.mark()
        stop(stream)
        steps.steps_until(since, lambda stats: stats.num_running == 1, what, within_steps=ABORTED_WITHIN_STEPS)
    finally:
        stream.cancel()


def test_client_cancel_frees_the_engine(client: DeadlineClient, split: Any) -> None:
    with witness(split) as steps:
        ended_by(lambda stream: stream.cancel(), steps, client, "the cancelled completions aborted")
    wait_until(lambda: engine_idle(split), what="engine idle after cancel")


def test_deadline_frees_the_engine(client: DeadlineClient, split: Any) -> None:
    error = rpc_error(lambda: list(client.generate(PROMPTS[1], timeout=0.5, **ENDLESS)))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: engine_idle(split), what="engine idle after deadline")


# ---- bad input and limits ---------------------------------------------------------------------------------

BAD_REQUESTS = [
    (dict(prompt=""), ["text"]),
    (dict(token_ids=[1, 100_000]), ["token_ids.ids"]),
    (dict(prompt="hi", temperature=float("nan")), ["sampling_params.temperature"]),
    (dict(prompt="hi", top_p=0.0), ["sampling_params.top_p"]),
    (dict(prompt="hi", max_tokens=2048), ["sampling_params.max_tokens"]),  # prompt + 2048 > max_model_len
    (dict(prompt="", top_k=-5), ["text", "sampling_params.top_k"]),
]


@pytest.mark.parametrize(("kwargs", "fields"), BAD_REQUESTS)
def test_bad_input_is_invalid_argument(client: DeadlineClient, kwargs: dict[str, Any], fields: list[str]) -> None:
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", None)
    error = rpc_error(lambda: list(client.generate(prompt, **kwargs)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sorted(details(error)[0]) == sorted(fields)


def test_oversize_message_is_resource_exhausted(client: DeadlineClient) -> None:
    error = rpc_error(lambda: list(client.generate("a" * (5 * 1024 * 1024), max_tokens=1)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert collect(client.generate(PROMPTS[0], max_tokens=2))[0]["finish_reason"] == pb.FINISH_REASON_LENGTH


def test_admission_limits(client: DeadlineClient, split: Any, second_frontend: Any) -> None:
    wait_until(lambda: routable(second_frontend), 30, "the second frontend routing to the engine")
    # 8 calls fill the frontend (limit 8) and the engine (4 running + 4 waiting). The engine counts a
    # burst as waiting until its next step, so the calls go in two rounds.
    streams = [client.generate(PROMPTS[i % len(PROMPTS)], **ENDLESS) for i in range(4)]
    try:
        for stream in streams:
            next(stream)
        streams += [client.generate(PROMPTS[i % len(PROMPTS)], **ENDLESS) for i in range(4)]
        wait_until(lambda: (engine_load(split).num_running, engine_load(split).num_waiting) == (4, 4),
                   what="4 running + 4 waiting")
        error = rpc_error(lambda: list(client.generate(PROMPTS[0], max_tokens=2)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details(error)[1] == "TOO_MANY_REQUESTS"
        with DeadlineClient(second_frontend.address) as other:
            error = rpc_error(lambda: list(other.generate(PROMPTS[0], max_tokens=2)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # the engine's --max-waiting
        assert details(error)[1] == "ENGINE_ERROR"
    finally:
        for stream in streams:
            stream.cancel()
    wait_until(lambda: engine_idle(split), what="engine idle")
    assert collect(client.generate(PROMPTS[0], max_tokens=2))[0]["finish_reason"] == pb.FINISH_REASON_LENGTH


# ---- health, reflection, other RPCs -------------------------------------------------------------------------


def test_health_reflection_and_model_info(client: DeadlineClient, split: Any, llm: Any) -> None:
    with grpc.insecure_channel(split.frontend.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "tandem.v1.GenerationService", "liveness"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        error = rpc_error(lambda: health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                   timeout=5))
    names = {s.name for s in answer.list_services_response.service}
    assert {"tandem.v1.GenerationService", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    info = client.model_info()
    assert info.max_model_len == llm.config.max_model_len and info.num_ready_engines == 1
    assert info.vocab_size == llm.engine.vocab_size
    ids = client.tokenize(PROMPTS[1])
    assert client.detokenize(ids) == PROMPTS[1]


def test_sigterm_drains_running_calls_and_exits_zero(split: Any) -> None:
    # A grace period no loaded CI machine outlasts: what is tested is that the running call finishes.
    frontend = split.start_frontend("--drain-grace-period", "60").wait_serving()
    try:
        with DeadlineClient(frontend.address) as c:
            stream = c.generate(PROMPTS[0], ignore_eos=True, max_tokens=200)
            first = next(stream)
            frontend.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: health_status(frontend.address) != health_pb2.HealthCheckResponse.SERVING,
                       what="NOT_SERVING while draining")
            error = rpc_error(lambda: list(c.generate(PROMPTS[1], max_tokens=2)))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(stream)
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 200
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert frontend.proc.wait(15) == 0
    finally:
        frontend.stop()


def test_a_second_sigterm_stops_at_once_and_exits_non_zero(split: Any) -> None:
    """As the engine does: a drain cut short by a second signal is not a clean exit."""
    frontend = split.start_frontend().wait_serving()
    try:
        with DeadlineClient(frontend.address) as c:
            stream = c.generate(PROMPTS[0], **ENDLESS)
            next(stream)
            frontend.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: health_status(frontend.address) != health_pb2.HealthCheckResponse.SERVING,
                       what="draining")
            frontend.proc.send_signal(signal.SIGTERM)
            assert frontend.proc.wait(15) == 1
            stream.cancel()
    finally:
        frontend.stop()
    wait_until(lambda: engine_idle(split), what="engine idle after the frontend stopped")


def test_a_second_engine_on_a_taken_port_fails_to_start(split: Any) -> None:
    """grpc turns SO_REUSEPORT on by default, which let a second engine share the port silently."""
    argv = [sys.executable, "-m", "engine_svc.cli", "--model", str(split.model), "--host", "127.0.0.1",
            "--port", str(split.engine.port), *ENGINE_FLAGS]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{split.engine.port}" in done.stderr
    assert health_status(split.engine.address) == health_pb2.HealthCheckResponse.SERVING  # the first is untouched


# ---- crashes (the engine is restarted on its port; a killed frontend is the test's own) -------------------------------------------------------------


def test_killing_a_frontend_frees_its_requests_in_the_engine(split: Any) -> None:
    frontend = split.start_frontend().wait_serving()  # its own: the module's frontends live on
    try:
        with witness(split) as steps, DeadlineClient(frontend.address) as other:
            ended_by(lambda stream: frontend.kill(), steps, other, "the dead frontend's requests aborted")
    finally:
        frontend.stop()
    wait_until(lambda: engine_idle(split), what="engine idle after the frontend died")


def test_killing_the_engine_fails_open_streams_and_the_frontend_recovers(client: DeadlineClient,
                                                                         split: Any) -> None:
    streams = [client.generate(p, **ENDLESS) for p in PROMPTS[:3]]
    for stream in streams:
        next(stream)
    split.engine.kill()
    started = time.monotonic()
    for stream in streams:
        error = rpc_error(lambda s=stream: list(s))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 5
    error = rpc_error(lambda: list(client.generate(PROMPTS[0], max_tokens=2)))
    assert error.code() == grpc.StatusCode.UNAVAILABLE  # no engine is ready
    split.restart_engine()
    split.engine.wait_serving()
    wait_until(lambda: routable(split.frontend), 30, "the frontend routing to the new engine")
    assert collect(client.generate(PROMPTS[0], max_tokens=3))[0]["finish_reason"] == pb.FINISH_REASON_LENGTH
