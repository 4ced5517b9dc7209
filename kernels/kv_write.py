"""Triton kernel writing this step's K/V into the paged cache through the slot mapping.

Grid: one program per token. Each program copies that token's [Hkv, D] key and value rows into
`kv_cache[0|1, slot // block_size, slot % block_size]`; a negative slot (padding) writes nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import LazyKernel, check_device, next_power_of_2, require_triton

# Bound to `triton.language` by LazyKernel at first launch; importing this module never imports triton.
tl: Any = None


def _kv_write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_kind,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    dst = (
        cache_ptr + blk * stride_c_blk + off * stride_c_slot + heads[:, None] * stride_c_head + dims[None, :]
    )
    k = tl.load(key_ptr + tok * stride_k_t + heads[:, None] * stride_k_h + dims[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_t + heads[:, None] * stride_v_h + dims[None, :], mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kind, v.to(cache_ptr.dtype.element_ty), mask=mask)


_kernel = LazyKernel(_kv_write_kernel)


def kv_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at `slot_mapping` [T].

    Slot s lands at block s // block_size, offset s % block_size; slot -1 (padding) is skipped.
    key/value may be strided views (e.g. slices of a fused qkv output) but their last dim must be
    contiguous; kv_cache must be contiguous in its last two dims.
    """
    require_triton()
    check_device(kv_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "key/value last dim must be contiguous"
    assert kv_cache.stride(-1) == 1 and kv_cache.stride(-2) == head_dim, (
        "kv_cache heads/dim must be contiguous"
    )
    _kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        HEADS_P=next_power_of_2(num_kv_heads),
        HEAD_DIM_P=next_power_of_2(head_dim),
    )
