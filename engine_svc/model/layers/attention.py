"""The model-side attention layer: shapes in, shapes out, the paged work done by a backend."""

from __future__ import annotations

import torch
from torch import nn

from engine_svc.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D], through `backend` over this layer's KV cache."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.sliding_window = sliding_window  # this layer's window (see attention/backend.py), None: full
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_written: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`kv_written`: this step's k/v are already in the cache (a fused kernel wrote them); `sinks`:
        this rank's heads' sink logits (gpt-oss)."""
        if sinks is None and self.sliding_window is None:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, kv_written=kv_written)
        else:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, kv_written=kv_written, sinks=sinks,
                                       sliding_window=self.sliding_window)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
