"""The executor <-> worker wire format: one op byte, then a msgpack body (msgspec, no pickle).

Commands (engine -> every worker, through the broadcast queue):
    LOAD_MODEL   no body      load the model, size the KV cache; rank 0 answers with `WorkerInfo`
    INIT_CACHE   CacheSpec    allocate that many KV blocks, size the batch for the served max_model_len;
                              rank 0 answers with an empty ack
    EXECUTE      SchedulerOutput                         rank 0 answers with `ModelRunnerOutput`
    SHUTDOWN     no body      leave the busy loop (no answer)
    KV_DESCRIBE  no body      P/D: every rank's K/V shard (an all-gather); the answer rank answers with them
                              (engine_svc/kv_transfer/shards.py)
    KV_READ      list[int]    P/D: those blocks, each rank's shard gathered to the answer rank, which
                              answers with their wire bytes

Responses (rank 0 -> engine) carry no op byte: the engine knows which command it is waiting for.
Decoders accept any buffer (bytes or a memoryview into shared memory); decoded objects own their data.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput


class Op(IntEnum):
    LOAD_MODEL = 1
    INIT_CACHE = 2
    EXECUTE = 3
    SHUTDOWN = 4
    KV_DESCRIBE = 5
    KV_READ = 6


class WorkerInfo(msgspec.Struct, array_like=True):
    """Rank 0's answer to LOAD_MODEL: num_blocks is already the minimum over all ranks."""

    num_blocks: int
    vocab_size: int
    kv_block_bytes: int


class CacheSpec(msgspec.Struct, array_like=True):
    """INIT_CACHE's body, the same for every rank: the KV blocks to allocate (the minimum over ranks) and the
    max_model_len the engine serves (the configured one, lowered to what those blocks hold)."""

    num_blocks: int
    max_model_len: int


_encoder = msgspec.msgpack.Encoder()
_so_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
_cache_spec_decoder = msgspec.msgpack.Decoder(CacheSpec)
_out_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
_info_decoder = msgspec.msgpack.Decoder(WorkerInfo)
_BODY_DECODERS: dict[Op, msgspec.msgpack.Decoder[Any] | None] = {
    Op.LOAD_MODEL: None,
    Op.INIT_CACHE: _cache_spec_decoder,
    Op.EXECUTE: _so_decoder,
    Op.SHUTDOWN: None,
    Op.KV_DESCRIBE: None,
    Op.KV_READ: msgspec.msgpack.Decoder(list[int]),
}


def encode_command(op: Op, body: object = None) -> bytearray:
    """op byte + msgpack(body); body must be None exactly when the op takes none."""
    if (_BODY_DECODERS[op] is None) != (body is None):
        raise ValueError(f"{op.name} {'takes no' if body is not None else 'needs a'} body")
    buf = bytearray((int(op),))
    if body is not None:
        _encoder.encode_into(body, buf, 1)
    return buf


def decode_command(buf: bytes | bytearray | memoryview) -> tuple[Op, object]:
    view = memoryview(buf)
    op = Op(view[0])
    decoder = _BODY_DECODERS[op]
    return op, (decoder.decode(view[1:]) if decoder is not None else None)


def encode_scheduler_output(so: SchedulerOutput) -> bytes:
    return _encoder.encode(so)


def decode_scheduler_output(buf: bytes | bytearray | memoryview) -> SchedulerOutput:
    return _so_decoder.decode(buf)


def encode_runner_output(out: ModelRunnerOutput) -> bytes:
    return _encoder.encode(out)


def decode_runner_output(buf: bytes | bytearray | memoryview) -> ModelRunnerOutput:
    return _out_decoder.decode(buf)


def encode_worker_info(info: WorkerInfo) -> bytes:
    return _encoder.encode(info)


def decode_worker_info(buf: bytes | bytearray | memoryview) -> WorkerInfo:
    return _info_decoder.decode(buf)


ACK = b""  # rank 0's answer to INIT_CACHE
