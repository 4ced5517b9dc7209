"""Torch reference for `kernels.kv_write.kv_write` (same signature, same effect)."""

from __future__ import annotations

import torch


def kv_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at `slot_mapping` [T].

    Slot s lands at block s // block_size, offset s % block_size; slot -1 (padding) is skipped.
    """
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[keep].to(kv_cache.dtype)
