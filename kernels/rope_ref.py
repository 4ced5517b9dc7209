"""Torch reference for `kernels.rope.rotary_qkv_` (same signature, same effect).

Deliberately plain: the optional q/k norm is `kernels.rms_norm_ref.rms_norm` per head, the rotation is
Hugging Face's `x * cos + rotate_half(x) * sin` evaluated in float32 and rounded once, and the cache
write is `kernels.kv_write_ref.kv_write`.
"""

from __future__ import annotations

import torch

from kernels.kv_write_ref import kv_write
from kernels.rms_norm_ref import rms_norm


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
    """In place on qkv [T, H + 2*Hkv, D]: optional per-head RMSNorm of q and k, rotation at `positions`;
    with kv_cache and slot_mapping, the rotated k and the v heads are written into the cache."""
    num_qk = num_heads + num_kv_heads
    qk = qkv[:, :num_qk]
    x = qk if qk_norm_weight is None else rms_norm(qk, qk_norm_weight, eps)
    x = x.float()
    half = qkv.shape[-1] // 2
    rows = cos_sin_cache[positions.long()].float()  # [T, 2, D]
    cos = rows[:, 0].unsqueeze(1)  # [T, 1, D]: cos over both halves
    sin = torch.cat((rows[:, 1, half:], rows[:, 1, half:]), dim=-1).unsqueeze(1)  # sin over both halves
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    qk.copy_(x * cos + rotated_half * sin)
    if kv_cache is not None:
        assert slot_mapping is not None, "kv_cache needs slot_mapping"
        kv_write(qk[:, num_heads:], qkv[:, num_qk:], kv_cache, slot_mapping)
