"""K/V blocks of an engine whose cache is split over ranks (tensor and pipeline parallelism).

Each rank holds a shard of every block: its TP rank's share of the KV heads, for its pipeline stage's
layers. On the wire a block is the concatenation of the shards in *wire order*: TP rank 0's stages in
order, then TP rank 1's, ... - so a TP rank's part is all the model's layers in order, whatever the
pipeline split, and engines of equal TP size but different pipeline stages exchange blocks as they are.

The bytes stay in the workers' processes except on the way between engines: a producer's ranks each read
their shard of the pulled blocks and gather them to the answer rank (one collective over every rank,
run as a command in step order), which hands the assembled blocks to the engine; a consumer's ranks each
take their shard (`ShardSlice`) of the blocks the step that admits the request carries. Every rank learns
every rank's shard once (`describe`, an all-gather) and keeps its own `ShardSlice`.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from engine_svc.kv_transfer.blocks import CacheLayout, ShardSlice, host_bytes, read_shard


class RankShard(msgspec.Struct, array_like=True, frozen=True):
    """One rank's part of a block: its layers, one layer's block shape, the element type, and the model's
    KV heads (all ranks')."""

    num_layers: int
    block_shape: tuple[int, ...]
    dtype: str
    num_kv_heads: int

    @property
    def block_bytes(self) -> int:
        elements = 1
        for dim in self.block_shape:
            elements *= dim
        return self.num_layers * elements * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


_shards_decoder = msgspec.msgpack.Decoder(list[RankShard])


def local_shard(kv_caches: list[torch.Tensor], model: Any) -> RankShard:
    """This rank's shard, from its allocated cache (one tensor per layer of its stage, blocks along dim 1)."""
    first = kv_caches[0]
    config = getattr(model, "config", None)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 0)
    return RankShard(len(kv_caches), tuple(int(d) for d in (first.shape[0], *first.shape[2:])),
                     str(first.dtype).removeprefix("torch."), int(heads or 0))


def wire_order(tp: int, pp: int) -> list[int]:
    """Global ranks in wire order (module docstring); global rank = stage * tp + TP rank."""
    return [stage * tp + tp_rank for tp_rank in range(tp) for stage in range(pp)]


def shard_slice(shards: list[RankShard], rank: int, tp: int, pp: int) -> ShardSlice:
    """Where global `rank`'s shard lies in a block's wire bytes (`shards` indexed by global rank)."""
    offset = 0
    for other in wire_order(tp, pp):
        if other == rank:
            break
        offset += shards[other].block_bytes
    return ShardSlice(offset, shards[rank].block_bytes, sum(s.block_bytes for s in shards))


def layout_of(shards: list[RankShard], model_name: str, block_size: int, tp: int) -> CacheLayout:
    """An engine's layout from its ranks' shards (indexed by global rank). Every rank's layer block has
    the same shape and type (TP shards the heads evenly or replicates them); TP rank 0's stages count the
    layers."""
    first = shards[0]
    for rank, shard in enumerate(shards):
        if (shard.block_shape, shard.dtype) != (first.block_shape, first.dtype):
            raise RuntimeError(f"rank {rank} holds K/V blocks of {shard.block_shape} {shard.dtype}, rank 0 "
                               f"{first.block_shape} {first.dtype}: they cannot travel as one layout")
    num_layers = sum(shards[r].num_layers for r in range(0, len(shards), tp))
    return CacheLayout(model_name, block_size, first.dtype, num_layers, first.block_shape, tp, first.num_kv_heads)


def describe(kv_caches: list[torch.Tensor], model: Any) -> list[RankShard]:
    """Every rank's shard, indexed by global rank (a collective: every rank calls it, in command order)."""
    import torch.distributed as dist

    mine = local_shard(kv_caches, model)
    if not dist.is_initialized():
        return [mine]
    table: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    return [RankShard(*s) if not isinstance(s, RankShard) else s for s in table]


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], shards: list[RankShard], tp: int, pp: int,
                  dst: int) -> bytes | None:
    """Blocks `block_ids` in wire bytes on rank `dst` (None on the others): each rank reads its shard and
    gathers it there (a collective over every rank). Shards of unequal size (uneven pipeline stages) are
    padded to the largest for the gather."""
    import torch.distributed as dist

    local = read_shard(kv_caches, block_ids)
    if not dist.is_initialized():
        return host_bytes(local)
    rank, width = dist.get_rank(), max(s.block_bytes for s in shards)
    padded = local if local.shape[1] == width else torch.nn.functional.pad(local, (0, width - local.shape[1]))
    parts = [torch.empty_like(padded) for _ in shards] if rank == dst else None
    dist.gather(padded.contiguous(), parts, dst=dst)
    if parts is None:
        return None
    return host_bytes(torch.cat([parts[r][:, :shards[r].block_bytes] for r in wire_order(tp, pp)], dim=1))


def encode_shards(shards: list[RankShard]) -> bytes:
    return msgspec.msgpack.encode(shards)


def decode_shards(data: bytes) -> list[RankShard]:
    return _shards_decoder.decode(data)


def describe_worker(worker: Any) -> bytes:
    """KV_DESCRIBE on one rank: every rank's shard (a collective); the worker keeps the table and its own
    `kv_shard` (where its part of a pulled block lies). The encoded table is the answer."""
    config = worker.config
    shards = describe(worker.runner.kv_caches, worker.model)
    worker.kv_shards = shards
    worker.kv_shard = shard_slice(shards, worker.rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    return encode_shards(shards)


def read_worker_blocks(worker: Any, block_ids: list[int], dst: int) -> bytes:
    """KV_READ on one rank: the blocks' wire bytes on rank `dst` (b"" on the others; a collective)."""
    config = worker.config
    data = gather_blocks(worker.runner.kv_caches, block_ids, worker.kv_shards, config.tensor_parallel_size,
                         config.pipeline_parallel_size, dst)
    return data if data is not None else b""
