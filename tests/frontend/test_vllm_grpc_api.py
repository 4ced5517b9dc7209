"""vLLM's gRPC API (`vllm.Inference`, `vllm.Control`) on a real frontend in front of a fake engine, over
real sockets: the same output as tandem's own API for the same request, vLLM's response shapes, n > 1,
logprobs with candidates, stop strings, structured outputs reaching the engine, Control.Abort, a dropped
stream aborting in the engine, bad input named by vLLM's field paths without stalling a concurrent
stream, API keys, the metrics and the trace span of each call.

The fake engine (tests/fake_engine.py) echoes the prompt's tokens, one per step, so greedy output is known.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.vendor.vllm import control_pb2 as cpb
from tandem.vendor.vllm import control_pb2_grpc as cpb_grpc
from tandem.vendor.vllm import inference_pb2 as ipb
from tandem.vendor.vllm import inference_pb2_grpc as ipb_grpc

from frontend_svc.telemetry.metrics import FrontendMetrics
from frontend_svc.telemetry.service import FrontendTelemetry
from tests.fake_engine import SEED_ENDLESS
from tests.observability.support import provider
from tests.security.secure_stack import Stack, Victim
from tests.support import MAX_STALL_S, LoopThread, bad_fields, max_gap, rpc_error, wait_until

KEY = "sk-vllm-grpc-1"
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = "The capital of France is"
TIMEOUT = 30


class Api:
    """Stubs of the three services on one channel, every call with the API key and a deadline."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.inference = ipb_grpc.InferenceStub(self.channel)
        self.control = cpb_grpc.ControlStub(self.channel)
        self.tandem = pb_grpc.GenerationServiceStub(self.channel)

    def stream(self, **fields: Any) -> list[ipb.GenerateResponse]:
        return list(self.inference.GenerateStream(ipb.GenerateRequest(**fields), metadata=AUTH, timeout=TIMEOUT))

    def unary(self, **fields: Any) -> ipb.GenerateResponse:
        return self.inference.Generate(ipb.GenerateRequest(**fields), metadata=AUTH, timeout=TIMEOUT)

    def tandem_text(self, **fields: Any) -> tuple[str, list[int]]:
        responses = list(self.tandem.Generate(pb.GenerateRequest(**fields), metadata=AUTH, timeout=TIMEOUT))
        return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def metrics() -> FrontendMetrics:
    return FrontendMetrics("tiny")


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path, exporter: InMemorySpanExporter,
          metrics: FrontendMetrics) -> Iterator[Stack]:
    telemetry = FrontendTelemetry("tiny", provider("tandem-frontend", exporter).get_tracer("test"), metrics)
    stack = Stack(loop, tokenizer, tiny_model_dir, api_keys=(KEY,), max_concurrent_requests=8,
                  max_model_len=4096, step_s=0.004, telemetry=telemetry)
    stack.wait_serving()
    yield stack
    stack.close()


@pytest.fixture()
def api(stack: Stack) -> Iterator[Api]:
    api = Api(stack.address)
    yield api
    api.channel.close()


def outputs(responses: list[ipb.GenerateResponse], index: int = 0) -> list[ipb.SequenceOutput]:
    return [r.outputs for r in responses if r.HasField("outputs") and r.outputs.index == index]


def test_greedy_stream_equals_tandem_s_own_api(api: Api, tokenizer: Any) -> None:
    responses = api.stream(text=PROMPT, stopping=ipb.StoppingCriteria(max_new_tokens=6),
                           response=ipb.ResponseOptions(output_token_ids=True, prompt_token_ids=True))
    want_text, want_ids = api.tandem_text(text=PROMPT, sampling_params=pb.SamplingParams(temperature=0, max_tokens=6))
    prompt_ids = tokenizer.encode(PROMPT)
    first = responses[0]
    assert first.HasField("prompt_info") and not first.HasField("outputs")  # vLLM: prompt info first, alone
    assert first.prompt_info.num_prompt_tokens == len(prompt_ids) and list(first.prompt_info.token_ids) == prompt_ids
    parts = outputs(responses)
    assert len(parts) > 1  # streamed
    assert "".join(p.text for p in parts) == want_text and [t for p in parts for t in p.token_ids] == want_ids
    assert all(p.num_tokens == len(p.token_ids) for p in parts)
    finish = parts[-1].finish_info
    assert finish.finish_reason == ipb.FinishInfo.LENGTH and finish.num_output_tokens == 6
    assert not any(p.HasField("finish_info") for p in parts[:-1])


def test_vllm_s_defaults_greedy_and_twenty_tokens(api: Api, stack: Stack) -> None:
    parts = outputs(api.stream(text=PROMPT))
    assert parts[-1].finish_info.num_output_tokens == 20
    assert not any(p.token_ids for p in parts)  # output_token_ids defaults to false
    assert "".join(p.text for p in parts).strip()  # output_text defaults to true
    assert last_engine_request(stack).sampling_params.temperature == 0  # unset temperature: greedy
    parts = outputs(api.stream(text=PROMPT, response=ipb.ResponseOptions(output_text=False)))
    assert not any(p.text for p in parts) and sum(p.num_tokens for p in parts) == 20


def last_engine_request(stack: Stack) -> Any:
    return stack.fake.added[-1]


def test_unary_generate_folds_the_stream(api: Api) -> None:
    request = {"text": PROMPT, "stopping": ipb.StoppingCriteria(max_new_tokens=5),
               "response": ipb.ResponseOptions(output_token_ids=True)}
    folded = api.unary(**request)
    parts = outputs(api.stream(**request))
    assert folded.prompt_info.num_prompt_tokens > 0
    assert folded.outputs.text == "".join(p.text for p in parts)
    assert list(folded.outputs.token_ids) == [t for p in parts for t in p.token_ids]
    assert folded.outputs.num_tokens == 5 and folded.outputs.finish_info.num_output_tokens == 5


def test_several_sequences_stream_with_their_index(api: Api) -> None:
    responses = api.stream(text=PROMPT, temperature=1.0, sampling=ipb.RandomSampling(num_sequences=3, seed=1),
                           stopping=ipb.StoppingCriteria(max_new_tokens=4))
    for index in range(3):
        parts = outputs(responses, index)
        assert parts and parts[-1].finish_info.num_output_tokens == 4
        assert sum(p.num_tokens for p in parts) == 4


def test_logprobs_and_candidates_are_parallel_arrays(api: Api, stack: Stack) -> None:
    responses = api.stream(text=PROMPT, stopping=ipb.StoppingCriteria(max_new_tokens=4),
                           response=ipb.ResponseOptions(output_logprobs=True, output_token_ids=True,
                                                        output_candidates=ipb.CandidateTokens(top_n=2)))
    parts = outputs(responses)
    ids = [t for p in parts for t in p.token_ids]
    logprobs = [lp for p in parts for lp in p.logprobs]
    ranks = [r for p in parts for r in p.ranks]
    candidates = [c for p in parts for c in p.candidate_tokens]
    assert len(ids) == len(logprobs) == len(ranks) == len(candidates) == 4
    for position in candidates:
        assert [t.rank for t in position.tokens] == [1, 2]
    assert last_engine_request(stack).sampling_params.logprobs == 2


def test_stop_strings_match_tandem_s_api(api: Api, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    stop = tokenizer.decode(ids[2:4]).strip()
    responses = api.stream(text=PROMPT, stopping=ipb.StoppingCriteria(max_new_tokens=12, stop_strings=[stop]))
    want, _ = api.tandem_text(text=PROMPT, sampling_params=pb.SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    parts = outputs(responses)
    assert "".join(p.text for p in parts) == want and stop not in want
    finish = parts[-1].finish_info
    assert finish.finish_reason == ipb.FinishInfo.STOP and finish.stop_string == stop


def test_stop_token_id_is_reported_as_such(api: Api, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    parts = outputs(api.stream(token_ids=ipb.TokenIds(ids=ids), stopping=ipb.StoppingCriteria(
        max_new_tokens=12, stop_token_ids=[ids[3]])))
    assert parts[-1].finish_info.stop_token_id == ids[3]


def test_structured_outputs_reach_the_engine(api: Api, stack: Stack) -> None:
    api.stream(text=PROMPT, decoding=ipb.DecodingParameters(choice=ipb.DecodingParameters.StringChoices(
        choices=["yes", "no"])), stopping=ipb.StoppingCriteria(max_new_tokens=2))
    assert list(last_engine_request(stack).sampling_params.structured_outputs.choice.choices) == ["yes", "no"]


def long_stream(api: Api, request_id: str) -> Victim:
    return Victim(api.inference.GenerateStream(ipb.GenerateRequest(
        request_id=request_id, text=PROMPT, sampling=ipb.RandomSampling(seed=SEED_ENDLESS), temperature=1.0,
        stopping=ipb.StoppingCriteria(max_new_tokens=4000)), metadata=AUTH, timeout=TIMEOUT))


def test_control_abort_ends_the_stream_with_aborted(api: Api, stack: Stack) -> None:
    aborted_before = len(stack.fake.aborted)
    responses: list[ipb.GenerateResponse] = []
    call = api.inference.GenerateStream(ipb.GenerateRequest(
        request_id="abort-me", text=PROMPT, temperature=1.0, sampling=ipb.RandomSampling(seed=SEED_ENDLESS),
        stopping=ipb.StoppingCriteria(max_new_tokens=4000)), metadata=AUTH, timeout=TIMEOUT)
    for response in call:
        responses.append(response)
        if len(responses) == 5:
            api.control.Abort(cpb.AbortRequest(request_ids=["abort-me", "unknown-id"]), metadata=AUTH)
    assert call.code() == grpc.StatusCode.OK
    parts = outputs(responses)
    finish = parts[-1].finish_info
    assert finish.finish_reason == ipb.FinishInfo.ABORTED
    assert finish.num_output_tokens == sum(p.num_tokens for p in parts) >= 3
    wait_until(lambda: len(stack.fake.aborted) > aborted_before, 5, "the abort in the engine")
    stack_idle(stack)


def stack_idle(stack: Stack) -> None:
    wait_until(lambda: not stack.fake.running and stack.frontend.admission.in_use == 0, 15, "idle")
    assert len(stack.frontend.vllm_in_flight) == 0


def test_a_dropped_stream_aborts_in_the_engine(api: Api, stack: Stack) -> None:
    before = len(stack.fake.aborted)
    victim = long_stream(api, "dropped")
    victim.wait_started()
    victim.stream.cancel()
    wait_until(lambda: len(stack.fake.aborted) > before, 10, "the engine abort")
    stack_idle(stack)


def test_bad_input_is_named_and_does_not_stall_a_stream(api: Api, stack: Stack) -> None:
    victim = long_stream(api, "victim")
    victim.wait_started()
    start = time.monotonic()
    error = rpc_error(lambda: api.stream(text=PROMPT, session_id="s", sampling=ipb.RandomSampling(top_p=3.0)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sorted(bad_fields(error)) == ["sampling.top_p", "session_id"]
    error = rpc_error(lambda: api.stream(text=PROMPT, lora_name="x"))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "LoRA adapter `x` not found" in error.details()
    error = rpc_error(lambda: api.stream(token_ids=ipb.TokenIds(ids=[1, 10**6])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_fields(error) == ["token_ids.ids"]
    error = rpc_error(lambda: api.stream(text="x" * 3_000_000))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_fields(error) == ["text"]
    error = rpc_error(lambda: api.stream(text=PROMPT, model="other-model"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    error = rpc_error(lambda: api.unary(text=PROMPT, temperature=1.0, sampling=ipb.RandomSampling(num_sequences=2)))
    assert bad_fields(error) == ["sampling.num_sequences"]
    error = rpc_error(lambda: api.stream())
    assert bad_fields(error) == ["prompt"]
    end = time.monotonic()
    time.sleep(0.05)
    assert victim.error is None and max_gap(victim.arrivals, start, end) < MAX_STALL_S
    victim.stream.cancel()
    stack_idle(stack)


def test_api_keys_guard_both_services(api: Api) -> None:
    error = rpc_error(lambda: list(api.inference.GenerateStream(ipb.GenerateRequest(text="x"), timeout=TIMEOUT)))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    error = rpc_error(lambda: api.control.GetModelInfo(cpb.GetModelInfoRequest(), timeout=TIMEOUT))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_control_describes_the_server(api: Api, stack: Stack) -> None:
    info = api.control.GetServerInfo(cpb.GetServerInfoRequest(), metadata=AUTH)
    assert info.engine_version.startswith("tandem ") and info.instance_id
    assert info.max_model_len == stack.frontend.max_model_len and info.kv_block_size == 16
    assert info.parallelism.tensor_parallel_size == 1 and info.parallelism.data_parallel_size == 1
    model = api.control.GetModelInfo(cpb.GetModelInfoRequest(), metadata=AUTH)
    assert model.served_model_name == stack.frontend.model_name
    assert model.supports_text_input and model.supports_token_ids_input and not model.supports_lora
    assert list(api.control.ListLoras(cpb.ListLorasRequest(), metadata=AUTH).adapters) == []
    error = rpc_error(lambda: api.control.LoadLora(cpb.LoadLoraRequest(lora_name="a", source_path="/x"),
                                                   metadata=AUTH))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    error = rpc_error(lambda: api.control.Shutdown(cpb.ShutdownRequest(), metadata=AUTH))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert not api.control.IsSleeping(cpb.IsSleepingRequest(), metadata=AUTH).sleeping
    assert not api.control.IsPaused(cpb.IsPausedRequest(), metadata=AUTH).paused
    stack.frontend.draining = True
    try:
        assert api.control.IsPaused(cpb.IsPausedRequest(), metadata=AUTH).paused
    finally:
        stack.frontend.draining = False
    [source] = api.control.GetKvEventSources(cpb.GetKvEventSourcesRequest(), metadata=AUTH).sources
    assert source.transport == "grpc" and source.endpoint == stack.frontend.config.engines[0]
    assert source.topic == "tandem.engine.v1.EngineCoreService.SubscribeKvEvents"
    health = health_pb2_grpc.HealthStub(api.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="vllm.Inference"), timeout=TIMEOUT).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_each_call_is_counted_and_traced(api: Api, metrics: FrontendMetrics, exporter: InMemorySpanExporter) -> None:
    def successes() -> float:
        value = metrics.registry.get_sample_value("tandem_request_success_total", {"finished_reason": "length",
                                                                                   "model_name": "tiny"})
        return float(value or 0)

    before = successes()
    exporter.clear()
    api.stream(text=PROMPT, stopping=ipb.StoppingCriteria(max_new_tokens=3))
    api.unary(text=PROMPT, stopping=ipb.StoppingCriteria(max_new_tokens=3))
    wait_until(lambda: successes() == before + 2, 5, "two successes counted")
    names = {span.name for span in exporter.get_finished_spans()}
    assert {"vllm.Inference/GenerateStream", "vllm.Inference/Generate"} <= names
