"""Contract structs (shared_runtime/contract.py) -> `tandem.engine.v1` protobuf: the one module for this
direction.

The frontend calls `add_to_pb` / `abort_to_pb` for what it sends on a `Connect` stream; the engine's
gRPC server calls `outputs_to_pb` once per step (on its asyncio thread, off the busy loop) and
`stats_to_load_pb` for GetLoad; the offline API calls `outputs_to_pb` so that its output processor reads
the same shape as the frontend's. The per-step path stays tight: repeated scalars go in with one
`extend`, defaults are not written, there is no per-field reflection per output.

Invariants (tests/protos/test_wire.py):
- struct -> pb -> struct (shared_runtime/from_pb.py) is the identity, except that logprobs and
  kv_cache_usage travel as 32-bit floats (values taken from float32 tensors survive exactly).
- `None` in a struct is an unset optional field; enum values pass by number (both sides share them).
- Sampling params are written by field name (`ENGINE_FIELDS`): a field added to `EngineSamplingParams`
  and to the proto under the same name needs nothing here.

tests/protos/test_wire.py::test_outputs_to_pb_timing prints what `outputs_to_pb` of one step costs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from tandem.engine.v1 import engine_core_pb2 as pb

from shared_runtime import contract as c

# ---- requests (frontend -> engine) ---------------------------------------------------------------------


def request_to_pb(request: c.EngineCoreRequest) -> pb.EngineCoreRequest:
    """The pb form of an EngineCoreRequest."""
    return pb.EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=sampling_params_to_pb(request.sampling_params),
        eos_token_ids=request.eos_token_ids,
        arrival_time=request.arrival_time,
        priority=request.priority,
        trace_headers=request.trace_headers,
        output_token_ids=request.output_token_ids,
        lora_name=request.lora_name,
        kv_transfer_params=(None if request.kv_transfer_params is None
                            else kv_transfer_params_to_pb(request.kv_transfer_params)),
    )


def kv_transfer_params_to_pb(params: c.KvTransferParams) -> pb.KvTransferParams:
    """The pb form of KvTransferParams (every field by name)."""
    return pb.KvTransferParams(**msgspec.structs.asdict(params))


def sampling_params_to_pb(params: c.EngineSamplingParams) -> pb.EngineSamplingParams:
    """Every engine field that is not None, by name (None leaves the optional unset). Only
    `ENGINE_FIELDS` are written, so a `SamplingParams` passed here sends its token-level part.
    Struct-valued fields go through their converter (`_MESSAGE_FIELDS`)."""
    fields: dict[str, Any] = {name: getattr(params, name) for name in c.ENGINE_FIELDS}
    for name in _SEQUENCE_FIELDS:
        fields[name] = [pb.TokenSequence(token_ids=ids) for ids in fields[name]]
    values: dict[str, Any] = {
        name: _MESSAGE_FIELDS[name](value) if name in _MESSAGE_FIELDS else value
        for name, value in fields.items() if value is not None
    }
    return pb.EngineSamplingParams(**values)


def structured_outputs_to_pb(so: c.StructuredOutputs) -> pb.StructuredOutputs:
    """The set constraint in the proto's oneof (an invalid struct with several set keeps the last)."""
    msg = pb.StructuredOutputs()
    for name in so.kinds():
        if name == "choice":
            msg.choice.choices.extend(so.choice or ())
        else:
            setattr(msg, name, getattr(so, name))
    if not so.kinds():  # present but empty: the engine refuses it ("got none"), as the struct says
        msg.SetInParent()
    return msg


_MESSAGE_FIELDS = {"structured_outputs": structured_outputs_to_pb}


# Fields holding lists of id lists (repeated TokenSequence on the wire).
_SEQUENCE_FIELDS = tuple(f.name for f in pb.EngineSamplingParams.DESCRIPTOR.fields
                         if f.message_type is pb.TokenSequence.DESCRIPTOR)


def add_to_pb(request: c.EngineCoreRequest) -> pb.EngineCoreInput:
    """An EngineCoreInput that adds `request`."""
    return pb.EngineCoreInput(add=request_to_pb(request))


def abort_to_pb(request_ids: Iterable[str]) -> pb.EngineCoreInput:
    """An EngineCoreInput that aborts `request_ids`."""
    return pb.EngineCoreInput(abort=pb.AbortRequests(request_ids=request_ids))


# ---- outputs (engine -> frontend), once per step ------------------------------------------------------


def outputs_to_pb(outputs: c.EngineCoreOutputs) -> pb.EngineCoreOutputs:
    """The pb form of one step's outputs. Fields at their default are left unwritten."""
    msg = pb.EngineCoreOutputs(timestamp=outputs.timestamp)
    add = msg.outputs.add
    for out in outputs.outputs:
        dst = add()
        dst.request_id = out.request_id
        dst.new_token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            _logprobs_into(dst.new_logprobs, out.new_logprobs)
        if out.prompt_logprobs:
            _logprobs_into(dst.prompt_logprobs, out.prompt_logprobs)
        if out.finish_reason:
            dst.finish_reason = out.finish_reason  # type: ignore[assignment]
        if out.stop_token_id is not None:
            dst.stop_token_id = out.stop_token_id
        if out.num_cached_tokens:
            dst.num_cached_tokens = out.num_cached_tokens
        if out.events:
            add_event = dst.events.add
            for event in out.events:
                add_event(type=event.type, timestamp=event.timestamp)
        if out.error is not None:
            dst.error.code = out.error.code  # type: ignore[assignment]
            dst.error.message = out.error.message
        if out.kv_transfer_params is not None:
            dst.kv_transfer_params.CopyFrom(kv_transfer_params_to_pb(out.kv_transfer_params))
    if outputs.scheduler_stats is not None:
        msg.scheduler_stats.CopyFrom(stats_to_pb(outputs.scheduler_stats))
    return msg


def _logprobs_into(
    dst: RepeatedCompositeFieldContainer[pb.TokenLogprobs], logprobs: Sequence[c.TokenLogprobs]
) -> None:
    add = dst.add
    for lp in logprobs:
        item = add()
        item.token_id = lp.token_id
        item.logprob = lp.logprob
        item.rank = lp.rank
        item.top_token_ids.extend(lp.top_token_ids)
        item.top_logprobs.extend(lp.top_logprobs)


# ---- load ---------------------------------------------------------------------------------------------


def stats_to_pb(stats: c.SchedulerStats) -> pb.SchedulerStats:
    """The pb form of SchedulerStats (the field names match one to one)."""
    return pb.SchedulerStats(**msgspec.structs.asdict(stats))


_LOAD_FIELDS = tuple(field.name for field in pb.EngineLoad.DESCRIPTOR.fields)


def stats_to_load_pb(stats: c.SchedulerStats | None) -> pb.EngineLoad:
    """The GetLoad answer from the latest scheduler stats; None (no step yet) is an idle engine."""
    if stats is None:
        return pb.EngineLoad()
    return pb.EngineLoad(**{name: getattr(stats, name) for name in _LOAD_FIELDS})
