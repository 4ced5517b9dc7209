"""The worker side of the connector: K/V blocks as bytes, read from and written into the paged cache.

A block's bytes are its layers in order, each layer's block as the cache holds it (`cache[:, block]`:
key and value, in the attention backend's layout). Both sides of a transfer hold the same layout
(`CacheLayout`, checked when the pull starts), so bytes written are bytes read. A read copies the blocks
to host memory (`.cpu()`: on CUDA this is the staging copy through host memory; RDMA is out of scope).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_svc.sched.output import KVBlockLoad


@dataclass(frozen=True)
class CacheLayout:
    """What two engines must share for blocks to move between them (tandem.engine.v1.KvCacheLayout)."""

    model_name: str
    block_size: int
    dtype: str
    num_layers: int
    block_shape: tuple[int, ...]
    tensor_parallel_size: int = 1

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers."""
        elements = 1
        for dim in self.block_shape:
            elements *= dim
        return self.num_layers * elements * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def mismatch(self, other: CacheLayout) -> str | None:
        """The first field where `other` differs, as a message naming both values (None: equal)."""
        for name in ("model_name", "block_size", "dtype", "num_layers", "block_shape", "tensor_parallel_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"KV cache layouts differ: {name} is {mine!r} here and {theirs!r} on the caller"
        return None


def layout_of(kv_caches: list[torch.Tensor], model_name: str, block_size: int, tp: int = 1) -> CacheLayout:
    """The layout of an allocated cache (one tensor per layer, blocks along dim 1)."""
    first = kv_caches[0]
    shape = (first.shape[0], *first.shape[2:])
    return CacheLayout(model_name, block_size, str(first.dtype).removeprefix("torch."), len(kv_caches),
                       tuple(int(d) for d in shape), tp)


def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> bytes:
    """The bytes of `block_ids`, block by block (module docstring): one gather per layer into a host
    buffer in wire order, then one copy into bytes."""
    first = kv_caches[0]
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    out = torch.empty((len(block_ids), len(kv_caches), first.shape[0], *first.shape[2:]), dtype=first.dtype)
    for layer, cache in enumerate(kv_caches):
        out[:, layer] = cache.index_select(1, index).transpose(0, 1)  # on CUDA: the copy to host
    return bytes(memoryview(out.view(-1).view(torch.uint8).numpy()))


def write_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], data: bytes) -> None:
    """Write `data` (as `read_blocks` returns it, for as many blocks) into `block_ids`."""
    first = kv_caches[0]
    shape = (len(block_ids), len(kv_caches), first.shape[0], *first.shape[2:])
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(first.dtype).view(shape)
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for layer, cache in enumerate(kv_caches):
        cache[:, index] = host[:, layer].transpose(0, 1).to(first.device)


def apply_loads(kv_caches: list[torch.Tensor], loads: list[KVBlockLoad]) -> None:
    """The worker's part of a step that admits pulled requests: their blocks, before the forward pass."""
    for load in loads:
        write_blocks(kv_caches, load.block_ids, load.data)
