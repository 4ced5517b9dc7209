"""shared_runtime.to_pb / from_pb: contract structs <-> protobuf, and engine_svc.api.output_packing.

Float values are chosen to be exact in float32 where the wire carries float32 (logprobs, kv_cache_usage).
"""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tandem.engine.v1 import engine_core_pb2 as pb
from tandem.v1 import generation_pb2 as public_pb

from engine_svc.api.output_packing import pack_outputs
from shared_runtime import contract as p
from shared_runtime import from_pb, to_pb


def _over_the_wire(message):  # type: ignore[no-untyped-def]
    """Serialize and parse again, as gRPC would."""
    return type(message).FromString(message.SerializeToString())


# ---- enums and field names -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("struct_enum", "pb_enum", "prefix"),
    [
        (p.FinishReason, pb.FinishReason, "FINISH_REASON_"),
        (p.EventType, pb.RequestEventType, "REQUEST_EVENT_TYPE_"),
        (p.ErrorCode, pb.ErrorCode, "ERROR_CODE_"),
    ],
)
def test_enum_numbers_match(struct_enum, pb_enum, prefix) -> None:  # type: ignore[no-untyped-def]
    assert {prefix + m.name: int(m) for m in struct_enum} == dict(pb_enum.items())


def test_public_finish_reason_numbers_match_the_struct() -> None:
    for name, number in public_pb.FinishReason.items():
        assert p.FinishReason[name.removeprefix("FINISH_REASON_")] == number


@pytest.mark.parametrize(
    ("struct", "message"),
    [
        (p.EngineSamplingParams, pb.EngineSamplingParams),
        (p.StructuredOutputs, pb.StructuredOutputs),
        (p.StructuredOutputs, public_pb.StructuredOutputs),
        (p.EngineCoreRequest, pb.EngineCoreRequest),
        (p.TokenLogprobs, pb.TokenLogprobs),
        (p.RequestEvent, pb.RequestEvent),
        (p.EngineError, pb.EngineError),
        (p.EngineCoreOutput, pb.EngineCoreOutput),
        (p.SchedulerStats, pb.SchedulerStats),
        (p.EngineCoreOutputs, pb.EngineCoreOutputs),
    ],
    ids=lambda x: x.__name__,
)
def test_messages_mirror_the_structs_field_for_field(struct, message) -> None:  # type: ignore[no-untyped-def]
    assert set(struct.__struct_fields__) == set(message.DESCRIPTOR.fields_by_name)


def test_the_public_sampling_params_are_the_contracts() -> None:
    """Every field of the contract's SamplingParams is in the public proto under its name, and back: a
    field added on one side only fails here. `bad_words_token_ids` is the processor's tokenization of the
    public `bad_words`, not a client field."""
    public = set(public_pb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert set(p.SamplingParams.__struct_fields__) - {"bad_words_token_ids"} == public


def test_optional_fields_are_the_structs_nullable_ones() -> None:
    nullable = {"seed", "max_tokens", "logprobs", "prompt_logprobs", "structured_outputs"}
    defaults_not_zero = {"temperature", "top_p", "repetition_penalty"}
    presence = {f.name for f in pb.EngineSamplingParams.DESCRIPTOR.fields if f.has_presence}
    assert presence == nullable | defaults_not_zero
    output_presence = {f.name for f in pb.EngineCoreOutput.DESCRIPTOR.fields if f.has_presence}
    assert output_presence == {"stop_token_id", "error", "kv_transfer_params"}


# ---- requests ------------------------------------------------------------------------------------------


def _full_request() -> p.EngineCoreRequest:
    return p.EngineCoreRequest(
        request_id="req-7",
        prompt_token_ids=[1, 15, 2**32 - 1],
        sampling_params=p.EngineSamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            seed=2**63 + 5,
            max_tokens=128,
            min_tokens=3,
            stop_token_ids=[7, 8],
            ignore_eos=True,
            presence_penalty=-0.3,
            frequency_penalty=1.1,
            repetition_penalty=1.2,
            logprobs=0,
            prompt_logprobs=5,
            logit_bias={7: -100.0, 2**32 - 1: 0.125},
            structured_outputs=p.StructuredOutputs(json='{"type": "object"}'),
        ),
        eos_token_ids=[2, 32000],
        arrival_time=1_700_000_000.123456,
        priority=-3,
        trace_headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )


def test_request_round_trip_keeps_every_field_exactly() -> None:
    request = _full_request()
    message = _over_the_wire(to_pb.request_to_pb(request))
    assert from_pb.request_from_pb(message) == request


def test_request_round_trip_of_defaults_keeps_none_and_explicit_zero_apart() -> None:
    request = p.EngineCoreRequest(
        request_id="r", prompt_token_ids=[5], sampling_params=p.EngineSamplingParams(logprobs=0)
    )
    message = _over_the_wire(to_pb.request_to_pb(request))
    params = message.sampling_params
    assert params.HasField("logprobs") and params.logprobs == 0
    assert not params.HasField("prompt_logprobs") and not params.HasField("seed")
    assert not params.HasField("max_tokens")
    back = from_pb.request_from_pb(message)
    assert back == request
    assert back.sampling_params.logprobs == 0 and back.sampling_params.prompt_logprobs is None


def test_unset_sampling_params_read_as_struct_defaults_not_proto_zeros() -> None:
    message = pb.EngineCoreRequest(request_id="r", prompt_token_ids=[1])
    request = from_pb.request_from_pb(message)
    assert request.sampling_params == p.EngineSamplingParams()
    assert request.sampling_params.temperature == 1.0 and request.sampling_params.top_p == 1.0
    assert request.sampling_params.repetition_penalty == 1.0


def test_greedy_temperature_zero_survives() -> None:
    params = p.EngineSamplingParams(temperature=0.0)
    message = _over_the_wire(to_pb.sampling_params_to_pb(params))
    assert message.HasField("temperature")
    assert from_pb.sampling_params_from_pb(message).temperature == 0.0


def test_a_frontend_sampling_params_sends_its_token_level_part() -> None:
    params = p.SamplingParams(temperature=0.5, stop=["x"], n=2, include_stop_str_in_output=True)
    message = _over_the_wire(to_pb.sampling_params_to_pb(params))
    assert from_pb.sampling_params_from_pb(message) == params.engine_params()


@settings(derandomize=True, max_examples=40, deadline=None)
@given(params=st.builds(
    p.EngineSamplingParams,
    temperature=st.floats(0, 2), top_p=st.floats(0, 1), top_k=st.integers(-1, 2**31 - 1),
    min_p=st.floats(0, 1), seed=st.none() | st.integers(0, 2**64 - 1),
    max_tokens=st.none() | st.integers(0, 2**32 - 1), min_tokens=st.integers(0, 2**32 - 1),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=3), ignore_eos=st.booleans(),
    presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2), repetition_penalty=st.floats(0, 9),
    logprobs=st.none() | st.integers(0, 2**32 - 1), prompt_logprobs=st.none() | st.integers(0, 2**32 - 1),
    logit_bias=st.dictionaries(st.integers(0, 2**32 - 1), st.floats(-100, 100), max_size=4),
    structured_outputs=st.none() | st.one_of(
        st.builds(p.StructuredOutputs, json=st.text(max_size=20)),
        st.builds(p.StructuredOutputs, json_object=st.just(True)),
        st.builds(p.StructuredOutputs, regex=st.text(max_size=20)),
        st.builds(p.StructuredOutputs, choice=st.lists(st.text(max_size=5), max_size=3)),
        st.builds(p.StructuredOutputs, grammar=st.text(max_size=20)),
        st.builds(p.StructuredOutputs, structural_tag=st.text(max_size=20)))))
def test_sampling_params_round_trip_property(params: p.EngineSamplingParams) -> None:
    assert from_pb.sampling_params_from_pb(_over_the_wire(to_pb.sampling_params_to_pb(params))) == params


def test_add_and_abort_inputs() -> None:
    add = _over_the_wire(to_pb.add_to_pb(_full_request()))
    assert add.WhichOneof("kind") == "add"
    assert from_pb.request_from_pb(add.add) == _full_request()
    abort = _over_the_wire(to_pb.abort_to_pb(iter(["a", "b"])))
    assert abort.WhichOneof("kind") == "abort"
    assert list(abort.abort.request_ids) == ["a", "b"]


# ---- outputs -------------------------------------------------------------------------------------------


def _logprobs(token_id: int, n_top: int) -> p.TokenLogprobs:
    return p.TokenLogprobs(
        token_id=token_id,
        logprob=-0.25 * token_id,
        rank=token_id % 3 + 1,
        top_token_ids=list(range(n_top)),
        top_logprobs=[-0.5 * i for i in range(n_top)],
    )


def _full_outputs() -> p.EngineCoreOutputs:
    return p.EngineCoreOutputs(
        outputs=[
            p.EngineCoreOutput(
                request_id="first",
                new_token_ids=[11],
                new_logprobs=[_logprobs(11, 2)],
                prompt_logprobs=[_logprobs(3, 0), _logprobs(4, 2)],
                num_cached_tokens=16,
                events=[
                    p.RequestEvent(p.EventType.QUEUED, 1_700_000_000.5),
                    p.RequestEvent(p.EventType.SCHEDULED, 1_700_000_000.75),
                    p.RequestEvent(p.EventType.FIRST_TOKEN, 1_700_000_001.0),
                ],
            ),
            p.EngineCoreOutput(
                request_id="stopped",
                new_token_ids=[0],
                finish_reason=p.FinishReason.STOP,
                stop_token_id=0,  # explicit zero: not the same as None
                events=[p.RequestEvent(p.EventType.FINISHED, 1_700_000_002.0)],
            ),
            p.EngineCoreOutput(request_id="long", new_token_ids=[5, 6], finish_reason=p.FinishReason.LENGTH),
            p.EngineCoreOutput(request_id="aborted", finish_reason=p.FinishReason.ABORT),
            p.EngineCoreOutput(
                request_id="failed",
                finish_reason=p.FinishReason.ERROR,
                error=p.EngineError(code=p.ErrorCode.INVALID_ARGUMENT, message="token id 99999 >= vocab"),
            ),
        ],
        scheduler_stats=p.SchedulerStats(
            num_running=3,
            num_waiting=2,
            kv_cache_usage=0.375,
            num_free_blocks=50,
            num_total_blocks=80,
            prefix_cache_queries=2**40,
            prefix_cache_hits=1024,
            num_preemptions=1,
            num_scheduled_tokens=37,
            num_prompt_tokens=33,
            num_generation_tokens=4,
        ),
        timestamp=1_700_000_002.25,
    )


def test_outputs_round_trip_keeps_every_field() -> None:
    outputs = _full_outputs()
    back = from_pb.outputs_from_pb(_over_the_wire(to_pb.outputs_to_pb(outputs)))
    assert back == outputs
    assert isinstance(back.outputs[1].finish_reason, p.FinishReason)
    assert isinstance(back.outputs[0].events[0].type, p.EventType)
    assert isinstance(back.outputs[4].error.code, p.ErrorCode)


def test_outputs_pb_reads_like_the_struct_by_attribute_name() -> None:
    message = to_pb.outputs_to_pb(_full_outputs())
    stopped = message.outputs[1]
    assert stopped.finish_reason == p.FinishReason.STOP == pb.FINISH_REASON_STOP
    assert stopped.HasField("stop_token_id") and stopped.stop_token_id == 0
    assert not message.outputs[2].HasField("stop_token_id")
    assert message.outputs[4].error.code == p.ErrorCode.INVALID_ARGUMENT
    assert not message.outputs[0].HasField("error")
    assert list(message.outputs[0].new_logprobs[0].top_token_ids) == [0, 1]
    assert message.scheduler_stats.num_running == 3


def test_outputs_without_stats_round_trip_to_none() -> None:
    outputs = p.EngineCoreOutputs(outputs=[p.EngineCoreOutput(request_id="x", new_token_ids=[1])])
    message = _over_the_wire(to_pb.outputs_to_pb(outputs))
    assert not message.HasField("scheduler_stats")
    assert from_pb.outputs_from_pb(message) == outputs


def test_default_fields_are_not_written() -> None:
    """A plain one-token output costs only its id and token on the wire."""
    outputs = p.EngineCoreOutputs(outputs=[p.EngineCoreOutput(request_id="abc", new_token_ids=[300])])
    expected = pb.EngineCoreOutputs(outputs=[pb.EngineCoreOutput(request_id="abc", new_token_ids=[300])])
    assert to_pb.outputs_to_pb(outputs).SerializeToString() == expected.SerializeToString()


def test_float32_fields_round_to_float32() -> None:
    outputs = p.EngineCoreOutputs(
        outputs=[
            p.EngineCoreOutput(
                request_id="x", new_logprobs=[p.TokenLogprobs(token_id=1, logprob=-0.1, rank=1)]
            )
        ],
        scheduler_stats=p.SchedulerStats(kv_cache_usage=0.1),
    )
    back = from_pb.outputs_from_pb(_over_the_wire(to_pb.outputs_to_pb(outputs)))
    assert back.outputs[0].new_logprobs[0].logprob == pytest.approx(-0.1, rel=1e-7)
    assert back.scheduler_stats is not None
    assert back.scheduler_stats.kv_cache_usage == pytest.approx(0.1, rel=1e-7)


_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
_u32 = st.integers(0, 2**32 - 1)
_token_logprobs = st.builds(
    p.TokenLogprobs,
    token_id=_u32,
    logprob=_f32,
    rank=_u32,
    top_token_ids=st.lists(_u32, max_size=3),
    top_logprobs=st.lists(_f32, max_size=3),
)
_error = st.builds(p.EngineError, code=st.sampled_from(p.ErrorCode), message=st.text(max_size=8))
_output = st.builds(
    p.EngineCoreOutput,
    request_id=st.text(max_size=8),
    new_token_ids=st.lists(_u32, max_size=3),
    new_logprobs=st.lists(_token_logprobs, max_size=2),
    prompt_logprobs=st.lists(_token_logprobs, max_size=2),
    finish_reason=st.sampled_from(p.FinishReason),
    stop_token_id=st.none() | _u32,
    num_cached_tokens=_u32,
    events=st.lists(st.builds(p.RequestEvent, st.sampled_from(p.EventType), st.floats(0, 2e9)), max_size=3),
    error=st.none() | _error,
)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(outputs=st.lists(_output, max_size=4), timestamp=st.floats(0, 2e9))
def test_outputs_round_trip_property(outputs: list[p.EngineCoreOutput], timestamp: float) -> None:
    struct = p.EngineCoreOutputs(outputs=outputs, timestamp=timestamp)
    assert from_pb.outputs_from_pb(_over_the_wire(to_pb.outputs_to_pb(struct))) == struct


# ---- load ----------------------------------------------------------------------------------------------


def test_stats_to_load_pb() -> None:
    stats = _full_outputs().scheduler_stats
    assert stats is not None
    load = _over_the_wire(to_pb.stats_to_load_pb(stats))
    assert load == pb.EngineLoad(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.375,
        num_free_blocks=50,
        num_total_blocks=80,
        prefix_cache_queries=2**40,
        prefix_cache_hits=1024,
    )
    assert to_pb.stats_to_load_pb(None) == pb.EngineLoad()


def test_stats_round_trip() -> None:
    stats = _full_outputs().scheduler_stats
    assert stats is not None
    assert from_pb.stats_from_pb(_over_the_wire(to_pb.stats_to_pb(stats))) == stats
    assert msgspec.structs.asdict(from_pb.stats_from_pb(pb.SchedulerStats())) == msgspec.structs.asdict(
        p.SchedulerStats()
    )


# ---- cost ----------------------------------------------------------------------------------------------


def test_outputs_to_pb_timing(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints the per-step cost of converting a 64-request decode step (no assertion on time)."""
    outputs = p.EngineCoreOutputs(
        outputs=[p.EngineCoreOutput(request_id=f"req-{i}", new_token_ids=[1000 + i]) for i in range(64)],
        scheduler_stats=_full_outputs().scheduler_stats,
        timestamp=1.0,
    )
    rounds = 300
    start = time.perf_counter()
    for _ in range(rounds):
        message = to_pb.outputs_to_pb(outputs)
    per_step_us = (time.perf_counter() - start) / rounds * 1e6
    assert len(message.outputs) == 64 and message.outputs[63].new_token_ids[0] == 1063
    with capsys.disabled():
        print(f"\n[wire] outputs_to_pb, 64 requests x 1 token: {per_step_us:.1f} us/step")


# ---- pack_outputs: queued steps -> messages under the size limit -----------------------------------------


def _step(step: int, num: int, id_len: int = 100) -> p.EngineCoreOutputs:
    outs = [p.EngineCoreOutput(request_id=f"r{i}-" + "x" * id_len, new_token_ids=[step, i]) for i in range(num)]
    return p.EngineCoreOutputs(outputs=outs, scheduler_stats=p.SchedulerStats(num_running=step), timestamp=step)


def test_pack_outputs_coalesces_small_steps_into_one_message() -> None:
    [message] = pack_outputs([_step(1, 2), _step(2, 2)], budget=1 << 20, limit=1 << 20)
    assert [list(o.new_token_ids) for o in message.outputs] == [[1, 0], [1, 1], [2, 0], [2, 1]]
    assert message.scheduler_stats.num_running == 2 and message.timestamp == 2


def test_pack_outputs_splits_in_order_under_the_budget_with_stats_last() -> None:
    steps = [_step(s, 8) for s in range(50)]
    budget = 4096
    messages = list(pack_outputs(steps, budget=budget, limit=budget))
    assert len(messages) > 1 and all(m.ByteSize() <= budget for m in messages)
    tokens = [list(o.new_token_ids) for m in messages for o in m.outputs]
    assert tokens == [[s, i] for s in range(50) for i in range(8)]
    assert [m.HasField("scheduler_stats") for m in messages] == [False] * (len(messages) - 1) + [True]
    assert messages[-1].scheduler_stats.num_running == 49


def test_an_output_larger_than_the_limit_becomes_an_error_for_its_request_alone() -> None:
    huge = p.EngineCoreOutput(request_id="huge", new_token_ids=list(range(100_000, 110_000)))
    small = p.EngineCoreOutput(request_id="small", new_token_ids=[1])
    dropped: list[str] = []
    messages = list(pack_outputs([p.EngineCoreOutputs(outputs=[huge, small])], budget=8192, limit=8192,
                                 on_oversized=dropped.append))
    assert dropped == ["huge"] and all(m.ByteSize() <= 8192 for m in messages)
    outs = {o.request_id: o for m in messages for o in m.outputs}
    assert outs["huge"].finish_reason == pb.FINISH_REASON_ERROR
    assert outs["huge"].error.code == pb.ERROR_CODE_INVALID_ARGUMENT and not outs["huge"].new_token_ids
    assert list(outs["small"].new_token_ids) == [1]


def test_nothing_of_a_request_follows_the_error_its_oversized_output_became() -> None:
    """The error is the request's end: its later outputs in the same message (steps coalesced behind a
    slow stream) are dropped, not sent after it."""
    huge = p.EngineCoreOutput(request_id="huge", new_token_ids=list(range(100_000, 110_000)))
    later = p.EngineCoreOutput(request_id="huge", new_token_ids=[7], finish_reason=p.FinishReason.LENGTH)
    other = p.EngineCoreOutput(request_id="other", new_token_ids=[1])
    steps = [p.EngineCoreOutputs(outputs=[huge, other]), p.EngineCoreOutputs(outputs=[later])]
    dropped: list[str] = []
    messages = list(pack_outputs(steps, budget=8192, limit=8192, on_oversized=dropped.append))
    outs = [o for m in messages for o in m.outputs]
    assert dropped == ["huge"]
    assert [(o.request_id, o.finish_reason) for o in outs] == [
        ("huge", pb.FINISH_REASON_ERROR), ("other", pb.FINISH_REASON_UNSPECIFIED)]
