"""Queued steps' outputs as `tandem.engine.v1.EngineCoreOutputs` messages that fit the link.

The engine's gRPC server hands each `Connect` stream the steps that queued up while it was writing;
`pack_outputs` converts them (shared_runtime/to_pb.py) into as few messages as possible under the
coalescing budget, and never one larger than the channel's maximum message size: a request whose output
alone is too large is ended with an INVALID_ARGUMENT error instead (its id allowing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from tandem.engine.v1 import engine_core_pb2 as pb

from shared_runtime.contract import EngineCoreOutputs
from shared_runtime.to_pb import outputs_to_pb


def pack_outputs(
    steps: Sequence[EngineCoreOutputs], budget: int, limit: int,
    on_oversized: Callable[[str], None] = lambda request_id: None,
) -> Iterator[pb.EngineCoreOutputs]:
    """Queued steps as few messages as possible, each at most `budget` bytes when it holds several
    outputs, and never more than `limit` (the channel's maximum message size).

    Outputs keep their order; the last message carries the last step's scheduler stats and timestamp.
    An output that alone exceeds `limit` cannot be sent: it is replaced by an INVALID_ARGUMENT error for
    its request (its id allowing), later outputs of that request are dropped, and
    `on_oversized(request_id)` is called so the engine stops it.
    """
    last = steps[-1]
    if len(steps) == 1:
        merged = last
    else:
        merged = EngineCoreOutputs(outputs=[o for step in steps for o in step.outputs],
                                   scheduler_stats=last.scheduler_stats, timestamp=last.timestamp)
    message = outputs_to_pb(merged)
    if message.ByteSize() <= budget:
        yield message
        return
    yield from _split(message, budget, limit, on_oversized)


_PER_OUTPUT_OVERHEAD = 6  # field tag + length prefix of one EngineCoreOutput in the repeated field


def _split(message: pb.EngineCoreOutputs, budget: int, limit: int,
           on_oversized: Callable[[str], None]) -> Iterator[pb.EngineCoreOutputs]:
    chunk = pb.EngineCoreOutputs(timestamp=message.timestamp)
    size = 0
    ended: set[str] = set()  # requests whose output became an error here: nothing of theirs follows it
    for out in message.outputs:
        if out.request_id in ended:
            continue
        out_size = out.ByteSize() + _PER_OUTPUT_OVERHEAD
        if out_size > limit - 64:
            ended.add(out.request_id)
            on_oversized(out.request_id)
            out = _oversized_error(out, limit)
            if out is None:
                continue
            out_size = out.ByteSize() + _PER_OUTPUT_OVERHEAD
        if chunk.outputs and size + out_size > budget:
            yield chunk
            chunk, size = pb.EngineCoreOutputs(timestamp=message.timestamp), 0
        chunk.outputs.append(out)
        size += out_size
    if message.HasField("scheduler_stats"):
        chunk.scheduler_stats.CopyFrom(message.scheduler_stats)
    yield chunk


def _oversized_error(out: pb.EngineCoreOutput, limit: int) -> pb.EngineCoreOutput | None:
    """An error output for a request whose output cannot be sent; None when even its id is too large."""
    error = pb.EngineCoreOutput(
        request_id=out.request_id, finish_reason=pb.FINISH_REASON_ERROR,
        error=pb.EngineError(code=pb.ERROR_CODE_INVALID_ARGUMENT,
                             message="this request's output is larger than the engine's maximum message "
                                     "size (e.g. prompt_logprobs of a very long prompt)"))
    return error if error.ByteSize() + _PER_OUTPUT_OVERHEAD <= limit - 64 else None
