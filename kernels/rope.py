"""Triton kernel: rotary embedding applied in place to q and k inside the fused qkv projection output,
optionally after Qwen3's per-head q/k RMSNorm, optionally writing the rotated K and V into the paged cache.

One kernel replaces, per layer: the cos/sin gather, the q/k norm (with its float32 copies), the
rotation (no `roll`: each head is read as its two halves x1, x2 and written as
(x1 cos - x2 sin, x2 cos + x1 sin)), and the separate KV-cache write.

Grid: one program per token. It loads the token's position once, its cos/sin row once, and all
H + Hkv query/key heads as a [heads, D/2] pair of tiles. Numerics: the norm rounds like Hugging Face's
RMSNorm (see kernels/rms_norm.py); the rotation is computed in float32 and rounded once.

Layouts: qkv [T, H + 2*Hkv, D] (any token and head strides, contiguous last dim): heads [0, H) are q,
[H, H + Hkv) are k, the rest v. cos_sin_cache [max_position, 2, D] as `RotaryEmbedding` builds it:
[p, 0] = cos(p f) over both halves, [p, 1] = (-sin(p f), sin(p f)). kv_cache
[2, num_blocks, block_size, Hkv, D]; slot s is block s // block_size, offset s % block_size; slot < 0
(padding) is not written. Positions must be < max_position (the caller validates on the host).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import LazyKernel, check_device, next_power_of_2, require_triton

# Bound to `triton.language` by LazyKernel at first launch; importing this module never imports triton.
tl: Any = None


def _rotary_qkv_kernel(
    qkv_ptr,
    pos_ptr,
    cache_ptr,
    norm_w_ptr,
    kv_ptr,
    slot_ptr,
    eps,
    stride_t,
    stride_h,
    stride_cache_pos,
    stride_cache_kind,
    stride_kv_kind,
    stride_kv_blk,
    stride_kv_slot,
    stride_kv_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    QK_HEADS_P: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    WRITE_KV: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    heads = tl.arange(0, QK_HEADS_P)
    dims = tl.arange(0, HALF_P)
    mask = (heads[:, None] < NUM_HEADS + NUM_KV_HEADS) & (dims[None, :] < HALF)
    lo_ptr = qkv_ptr + tok * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    if HAS_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w_ptr = norm_w_ptr + heads[:, None] * HEAD_DIM + dims[None, :]
        w1 = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    row = cache_ptr + pos * stride_cache_pos + dims
    cos = tl.load(row, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + stride_cache_kind + HALF, mask=dims < HALF, other=0.0).to(tl.float32)
    o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    tl.store(lo_ptr, o1, mask=mask)
    tl.store(lo_ptr + HALF, o2, mask=mask)

    if WRITE_KV:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        # (the interpreter rejects store masks that combine a scalar bool with a block: broadcast first)
        slot_base = (slot // BLOCK_SIZE) * stride_kv_blk + (slot % BLOCK_SIZE) * stride_kv_slot
        # rotated keys: rows [H, H + Hkv) of the tiles above
        is_key = (heads >= NUM_HEADS) & (heads < NUM_HEADS + NUM_KV_HEADS) & (heads * 0 + slot >= 0)
        k_dst = kv_ptr + slot_base + (heads[:, None] - NUM_HEADS) * stride_kv_head + dims[None, :]
        k_mask = is_key[:, None] & (dims[None, :] < HALF)
        tl.store(k_dst, o1.to(kv_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k_dst + HALF, o2.to(kv_ptr.dtype.element_ty), mask=k_mask)
        # values: copied as they are
        kv_heads = tl.arange(0, KV_HEADS_P)
        full = tl.arange(0, HEAD_DIM_P)
        v_mask = (kv_heads[:, None] < NUM_KV_HEADS) & (full[None, :] < HEAD_DIM) & (kv_heads[:, None] * 0 + slot >= 0)
        v_src = qkv_ptr + tok * stride_t + (NUM_HEADS + NUM_KV_HEADS + kv_heads[:, None]) * stride_h
        v = tl.load(v_src + full[None, :], mask=v_mask, other=0.0)
        v_dst = kv_ptr + stride_kv_kind + slot_base + kv_heads[:, None] * stride_kv_head + full[None, :]
        tl.store(v_dst, v.to(kv_ptr.dtype.element_ty), mask=v_mask)


_kernel = LazyKernel(_rotary_qkv_kernel)


def rotary_qkv_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    qk_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """In place on qkv [T, H + 2*Hkv, D]: optional per-head RMSNorm of q and k (qk_norm_weight
    [H + Hkv, D]), then the rotation at `positions` [T]; with kv_cache and slot_mapping [T], also write
    the rotated k and the v heads into the cache (slot -1 = padding, skipped). See the module docstring."""
    require_triton()
    check_device(qkv)
    num_tokens, total_heads, head_dim = qkv.shape
    assert total_heads == num_heads + 2 * num_kv_heads, "qkv must hold H + 2*Hkv heads"
    assert head_dim % 2 == 0 and qkv.stride(-1) == 1, "head_dim must be even and contiguous"
    assert cos_sin_cache.shape[1:] == (2, head_dim) and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    write_kv = kv_cache is not None
    if write_kv:
        assert slot_mapping is not None, "kv_cache needs slot_mapping"
        assert kv_cache.shape[3:] == (num_kv_heads, head_dim) and kv_cache.stride(-1) == 1
    if qk_norm_weight is not None:
        assert qk_norm_weight.shape == (num_heads + num_kv_heads, head_dim) and qk_norm_weight.is_contiguous()
    kv = kv_cache if write_kv else qkv
    half = head_dim // 2
    _kernel[(num_tokens,)](
        qkv,
        positions,
        cos_sin_cache,
        qkv if qk_norm_weight is None else qk_norm_weight,
        kv,
        positions if slot_mapping is None else slot_mapping,
        eps,
        qkv.stride(0),
        qkv.stride(1),
        cos_sin_cache.stride(0),
        cos_sin_cache.stride(1),
        kv.stride(0),
        kv.stride(1) if write_kv else 0,
        kv.stride(2) if write_kv else 0,
        kv.stride(3) if write_kv else 0,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_P=next_power_of_2(half),
        QK_HEADS_P=next_power_of_2(num_heads + num_kv_heads),
        KV_HEADS_P=next_power_of_2(num_kv_heads),
        HEAD_DIM_P=next_power_of_2(head_dim),
        BLOCK_SIZE=kv.shape[2] if write_kv else 1,
        HAS_NORM=qk_norm_weight is not None,
        WRITE_KV=write_kv,
    )
