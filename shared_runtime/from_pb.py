"""`tandem.engine.v1` protobuf -> contract structs (shared_runtime/contract.py): the one module for this
direction.

The engine's gRPC server calls `request_from_pb` once per added request (no validation here: the
engine checks ids, ranges and sizes when the request is added, engine_svc/validation.py).
`outputs_from_pb` is the inverse of `to_pb.outputs_to_pb` for tests and tools; the frontend reads
received outputs as protobuf directly (why: shared_runtime/contract.py).

Invariants (tests/protos/test_wire.py):
- An unset optional field becomes the struct's default: None, or 1.0 for temperature, top_p and
  repetition_penalty (never proto3's 0).
- Sampling params are read by field name, driven by the proto's descriptor (optional, repeated, map and
  token-sequence fields each read their own way), so a field added to the proto and to `EngineSamplingParams` under the
  same name needs nothing here; a field on one side only fails the field-set test.
"""

from __future__ import annotations

import enum
from typing import Any

from tandem.engine.v1 import engine_core_pb2 as pb
from tandem.v1 import generation_pb2 as pub

from shared_runtime import contract as c


class _Kind(enum.Enum):
    SCALAR = 0  # proto3 implicit presence: the value as is
    OPTIONAL = 1  # explicit presence: unset -> the struct default
    REPEATED = 2  # -> list
    MAP = 3  # -> dict
    SEQUENCES = 4  # repeated TokenSequence -> list of lists of ids
    MESSAGE = 5  # -> its struct (`_MESSAGE_FIELDS`), or None when unset


def _kind(field: Any) -> _Kind:
    """How to read `field` (a protobuf FieldDescriptor, pure-python or upb)."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return _Kind.MAP
    if field.is_repeated:
        return _Kind.SEQUENCES if field.message_type is pb.TokenSequence.DESCRIPTOR else _Kind.REPEATED
    if field.message_type is not None:
        return _Kind.MESSAGE
    return _Kind.OPTIONAL if field.has_presence else _Kind.SCALAR


_SAMPLING_PLAN = tuple((field.name, _kind(field)) for field in pb.EngineSamplingParams.DESCRIPTOR.fields)
_SAMPLING_DEFAULTS = c.EngineSamplingParams()


# ---- requests ------------------------------------------------------------------------------------------


def request_from_pb(msg: pb.EngineCoreRequest) -> c.EngineCoreRequest:
    """The struct form of a pb EngineCoreRequest."""
    return c.EngineCoreRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling_params=sampling_params_from_pb(msg.sampling_params),
        eos_token_ids=list(msg.eos_token_ids),
        arrival_time=msg.arrival_time,
        priority=msg.priority,
        trace_headers=dict(msg.trace_headers),
        output_token_ids=list(msg.output_token_ids),
        lora_name=msg.lora_name,
        kv_transfer_params=(kv_transfer_params_from_pb(msg.kv_transfer_params)
                            if msg.HasField("kv_transfer_params") else None),
    )


def kv_transfer_params_from_pb(msg: pb.KvTransferParams) -> c.KvTransferParams:
    """The struct form of a pb KvTransferParams."""
    return c.KvTransferParams(
        do_remote_decode=msg.do_remote_decode, do_remote_prefill=msg.do_remote_prefill,
        remote_engine_id=msg.remote_engine_id, remote_host=msg.remote_host, remote_port=msg.remote_port,
        remote_request_id=msg.remote_request_id, remote_block_ids=list(msg.remote_block_ids),
        remote_num_tokens=msg.remote_num_tokens,
    )


def sampling_params_from_pb(msg: pb.EngineSamplingParams) -> c.EngineSamplingParams:
    """Every field by name; an unset optional reads as the struct's default."""
    has = msg.HasField
    fields: dict[str, object] = {}
    for name, kind in _SAMPLING_PLAN:
        value = getattr(msg, name)
        if kind is _Kind.REPEATED:
            value = list(value)
        elif kind is _Kind.SEQUENCES:
            value = [list(sequence.token_ids) for sequence in value]
        elif kind is _Kind.MAP:
            value = dict(value)
        elif kind is _Kind.MESSAGE:
            value = _MESSAGE_FIELDS[name](value) if has(name) else None
        elif kind is _Kind.OPTIONAL and not has(name):
            value = getattr(_SAMPLING_DEFAULTS, name)
        fields[name] = value
    return c.EngineSamplingParams(**fields)  # type: ignore[arg-type]


def structured_outputs_from_pb(msg: pb.StructuredOutputs | pub.StructuredOutputs) -> c.StructuredOutputs:
    """The struct with the oneof's one field set (none, when the message is empty). The public
    `tandem.v1.StructuredOutputs` has the same fields, so the gRPC API's mapper uses this too."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return c.StructuredOutputs()
    if kind == "choice":
        return c.StructuredOutputs(choice=list(msg.choice.choices))
    return c.StructuredOutputs(**{kind: getattr(msg, kind)})


_MESSAGE_FIELDS = {"structured_outputs": structured_outputs_from_pb}


# ---- outputs -------------------------------------------------------------------------------------------


def outputs_from_pb(msg: pb.EngineCoreOutputs) -> c.EngineCoreOutputs:
    """The struct form of one step's outputs; an unset scheduler_stats becomes None."""
    return c.EngineCoreOutputs(
        outputs=[_output_from_pb(out) for out in msg.outputs],
        scheduler_stats=stats_from_pb(msg.scheduler_stats) if msg.HasField("scheduler_stats") else None,
        timestamp=msg.timestamp,
    )


def _output_from_pb(msg: pb.EngineCoreOutput) -> c.EngineCoreOutput:
    error = msg.error
    return c.EngineCoreOutput(
        request_id=msg.request_id,
        new_token_ids=list(msg.new_token_ids),
        new_logprobs=[_logprob_from_pb(lp) for lp in msg.new_logprobs],
        prompt_logprobs=[_logprob_from_pb(lp) for lp in msg.prompt_logprobs],
        finish_reason=c.FinishReason(msg.finish_reason),
        stop_token_id=msg.stop_token_id if msg.HasField("stop_token_id") else None,
        num_cached_tokens=msg.num_cached_tokens,
        events=[c.RequestEvent(c.EventType(e.type), e.timestamp) for e in msg.events],
        error=(
            c.EngineError(code=c.ErrorCode(error.code), message=error.message)
            if msg.HasField("error")
            else None
        ),
        kv_transfer_params=(kv_transfer_params_from_pb(msg.kv_transfer_params)
                            if msg.HasField("kv_transfer_params") else None),
    )


def _logprob_from_pb(msg: pb.TokenLogprobs) -> c.TokenLogprobs:
    return c.TokenLogprobs(
        token_id=msg.token_id,
        logprob=msg.logprob,
        rank=msg.rank,
        top_token_ids=list(msg.top_token_ids),
        top_logprobs=list(msg.top_logprobs),
    )


def stats_from_pb(msg: pb.SchedulerStats) -> c.SchedulerStats:
    """The struct form of a pb SchedulerStats."""
    stats = c.SchedulerStats(**{name: getattr(msg, name) for name in c.SchedulerStats.__struct_fields__})
    stats.spec_decode_num_accepted_tokens_per_pos = list(stats.spec_decode_num_accepted_tokens_per_pos)
    stats.running_lora_adapters = dict(msg.running_lora_adapters)
    stats.waiting_lora_adapters = dict(msg.waiting_lora_adapters)
    return stats
