"""The worker side of the connector: K/V blocks as bytes, read from and written into the paged cache.

A block's bytes on the wire are its shards in wire order (shards.py: TP rank by TP rank, and within one
TP rank its pipeline stages in order), each shard its layers in order, each layer's block as the cache
holds it (`cache[:, block]`: key and value, in the attention backend's layout). With one rank the block
is its layers in order. Both sides of a transfer hold the same layout (`CacheLayout`, checked when the
pull starts), so bytes written are bytes read; a rank writes its own shard (`ShardSlice`) of each block.
A read to host memory (`read_blocks`) is, on CUDA, the staging copy through host memory (RDMA is out of
scope). A cache in host memory whose layer tensors are contiguous can instead be sent as it lies
(`cache_views`): one view per layer, cache part and block, in wire order, with no copy at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_svc.sched.output import KVBlockLoad


@dataclass(frozen=True)
class CacheLayout:
    """What two engines must share for blocks to move between them (tandem.engine.v1.KvCacheLayout).
    `block_shape` is one rank's block of one layer (its share of the KV heads); `num_layers` counts every
    layer of the model, whatever the pipeline stages (they may differ between the two engines: the wire
    order puts a TP rank's stages back in layer order)."""

    model_name: str
    block_size: int
    dtype: str
    num_layers: int
    block_shape: tuple[int, ...]
    tensor_parallel_size: int = 1
    num_kv_heads: int = 0  # the model's, over all TP ranks (0: not reported)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers and all TP ranks (as it travels)."""
        elements = 1
        for dim in self.block_shape:
            elements *= dim
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.tensor_parallel_size * self.num_layers * elements * itemsize

    def mismatch(self, other: CacheLayout) -> str | None:
        """The first field where `other` differs, as a message naming both values (None: equal)."""
        for name in ("model_name", "num_kv_heads", "tensor_parallel_size", "block_size", "dtype", "num_layers",
                     "block_shape"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                more = (" (K/V moves only between equal tensor-parallel sizes; unequal ones would need the "
                        "heads re-sharded, which this connector does not do)" if name == "tensor_parallel_size"
                        else "")
                return f"KV cache layouts differ: {name} is {mine!r} here and {theirs!r} on the caller{more}"
        return None


@dataclass(frozen=True)
class ShardSlice:
    """Where one rank's shard lies in a block's wire bytes: `size` bytes from `offset`, of `total`."""

    offset: int
    size: int
    total: int


def read_shard(kv_caches: list[torch.Tensor], block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's shard of `block_ids`, block by block, as a uint8 tensor (blocks, shard bytes) on the
    cache's device: one gather per layer and cache part (key, value), written in place into `out` when
    given (a contiguous uint8 tensor on that device of at least that many bytes; the result views it)."""
    first = kv_caches[0]
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    shape = (len(block_ids), len(kv_caches), first.shape[0], *first.shape[2:])
    if out is None:
        blocks = torch.empty(shape, dtype=first.dtype, device=first.device)
    else:
        blocks = out.view(-1)[:len(block_ids) * len(kv_caches) * first[:, 0].nbytes].view(first.dtype).view(shape)
    for layer, cache in enumerate(kv_caches):
        for part in range(first.shape[0]):
            torch.index_select(cache[part], 0, index, out=blocks[:, layer, part])
    return blocks.view(len(block_ids), -1).view(torch.uint8)


def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], out: memoryview | None = None) -> memoryview:
    """The bytes of `block_ids` of a one-rank cache (module docstring), in host memory: a view of the
    host buffer they were gathered into (no copy into a bytes object). With `out` (a writable buffer of
    at least their size, reused from read to read: fresh host memory costs a page fault per page) they
    are gathered into it - on CUDA through a device buffer - and the result views it."""
    device = kv_caches[0].device
    if out is None:
        return read_shard(kv_caches, block_ids).cpu().contiguous().view(-1).numpy().data
    host = torch.frombuffer(out, dtype=torch.uint8)
    if device.type == "cpu":
        data = read_shard(kv_caches, block_ids, host).view(-1)
    else:
        shard = read_shard(kv_caches, block_ids).view(-1)
        data = host[:shard.numel()]
        data.copy_(shard)
    return out[:data.numel()]


# The wire bytes of these blocks as views of the cache's own memory, in wire order (cache_views)
BlockViews = Callable[[list[int]], list[memoryview]]


def cache_views(kv_caches: list[torch.Tensor]) -> BlockViews | None:
    """Views of a one-rank cache's blocks in wire order, or None when its layout forces the staging copy
    (`read_blocks`): a cache on a device (its bytes must be copied to host memory first), or a layer
    tensor that is not contiguous or not shaped like the first (a block's part would not be one run of
    bytes). The views read the cache itself: they hold the blocks' bytes only while the blocks are held
    (a lease), and the caller must not write through them. Each is one layer's cache part (key, value) of
    one block - `cache[part, block]`, one contiguous run; consecutive block ids do not make longer runs,
    since the wire is block-major and the cache layer-major."""
    if not kv_caches:
        return None
    first = kv_caches[0]
    if any(c.device.type != "cpu" or not c.is_contiguous() or c.shape != first.shape or c.dtype != first.dtype
           for c in kv_caches):
        return None
    parts, num_blocks = int(first.shape[0]), int(first.shape[1])
    run = first[0, 0].nbytes  # one part of one block of one layer
    # numpy's array keeps its tensor alive, the memoryview its array
    flats = [c.view(-1).view(torch.uint8).numpy().data for c in kv_caches]
    part_starts = [part * num_blocks * run for part in range(parts)]

    def views(block_ids: list[int]) -> list[memoryview]:
        out: list[memoryview] = []
        append = out.append
        for block in block_ids:
            if not 0 <= block < num_blocks:
                raise IndexError(f"block {block} is not in a cache of {num_blocks} blocks")
            offset = block * run
            for flat in flats:
                for start in part_starts:
                    append(flat[start + offset:start + offset + run])
        return out

    return views


_CPU = torch.device("cpu")


def staging_buffer(nbytes: int, device: torch.device = _CPU) -> memoryview:
    """Host memory for the spans a pull reads from a cache on `device` (source.py reuses it span after
    span): page-locked (pinned) for a CUDA cache, so each device-to-host copy is one DMA at the link's
    speed rather than a copy through a driver bounce buffer; plain memory for a CPU cache."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda").numpy().data


def host_bytes(data: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes, copied to host memory first if it lives on a device."""
    return bytes(data.cpu().contiguous().view(-1).numpy().data)


def write_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], data: bytes | bytearray | memoryview,
                 shard: ShardSlice | None = None) -> None:
    """Write this rank's `shard` of `data` (wire bytes for as many blocks; None: all of each block) into
    `block_ids`. A writable `data` (a pull's buffer) is read in place; a read-only one is copied first
    (torch reads buffers only through writable views)."""
    first = kv_caches[0]
    shape = (len(block_ids), len(kv_caches), first.shape[0], *first.shape[2:])
    view = memoryview(data)
    host = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8).view(len(block_ids), -1)
    if shard is not None:
        if host.shape[1] != shard.total:
            raise ValueError(f"pulled blocks of {host.shape[1]} bytes, expected {shard.total}")
        host = host[:, shard.offset:shard.offset + shard.size].contiguous()
    blocks = host.view(first.dtype).view(shape)
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for layer, cache in enumerate(kv_caches):
        cache[:, index] = blocks[:, layer].transpose(0, 1).to(first.device)


def apply_loads(kv_caches: list[torch.Tensor], loads: list[KVBlockLoad], shard: ShardSlice | None = None) -> None:
    """The worker's part of a step that admits pulled requests: their blocks (this rank's `shard` of them),
    before the forward pass."""
    for load in loads:
        write_blocks(kv_caches, load.block_ids, load.data, shard)
