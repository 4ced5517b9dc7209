"""RMSNorm: weight * x / rms(x), with the statistics in float32 like HF.

One fused torch kernel per call in every dtype (it accumulates half types in float32): no float32 copy of
the activations and no conversion back. In float32 this is HF's computation exactly; in half types the
weight is applied before the result is rounded once (HF rounds, then multiplies by the weight).

`fused=True` (set by the model when it runs the Triton attention backend) computes the same with the
Triton kernels of `kernels/rms_norm.py`: one pass per row, and the residual add fused in place.
On CPU in float32 / bfloat16 the residual form runs the native `add_rms_norm_` op
(engine_svc/attention/csrc/cpu_fused_ops.cpp: one pass per row, in place) when it is built; the torch
ops are the fallback and the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.attention import cpu_paged
from engine_svc.model.layers.linear import copy_full, make_param
from kernels import rms_norm as triton_norm  # importing kernels never imports triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise over the last dim; `weight` broadcasts against x (shape [D] or e.g. [H, D])."""
    dim = (x.shape[-1],)
    if weight.dim() == 1:
        return F.rms_norm(x, dim, weight, eps)
    return F.rms_norm(x, dim, None, eps) * weight


class RMSNorm(nn.Module):
    """`forward(x)` -> norm(x); `forward(x, residual)` -> (norm(x + residual), x + residual).

    The second form is the pre-norm decoder's "add the residual, then normalise" step in one call,
    returning the new residual stream alongside the normalised activations.

    With `fused`, or on CPU where the native op is built, the second form works in place (vLLM's
    fused_add_rms_norm): `residual` becomes x + residual and `x` its normalisation; both tensors are
    returned. Callers must own both.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        params_dtype: torch.dtype | None = None,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = make_param((hidden_size,), params_dtype, copy_full)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            if residual is None:
                return triton_norm.rms_norm(x, self.weight, self.eps)
            triton_norm.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        native = cpu_paged.for_tensor(x)
        if native is not None:
            native.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x


class QKNorm(nn.Module):
    """Per-head RMSNorm of queries and keys together (Qwen3), applied to the fused [T, H + Hkv, D] view.

    `weight` is [H + Hkv, D]: rows [0, H) hold the q_norm weight, rows [H, H + Hkv) the k_norm weight,
    so one normalisation covers both. Loaded with shard_id "q" (q_norm) and "k" (k_norm).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.eps = num_heads, eps
        self.weight = make_param((num_heads + num_kv_heads, head_dim), params_dtype, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id == "q":
            rows = param.data[: self.num_heads]
        elif shard_id == "k":
            rows = param.data[self.num_heads :]
        else:
            raise ValueError(f"QKNorm shard_id must be 'q' or 'k', got {shard_id!r}")
        if loaded.shape != param.shape[1:]:
            raise ValueError(f"shape mismatch: expected ({param.shape[1]},), got {tuple(loaded.shape)}")
        rows.copy_(loaded.expand_as(rows))

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        return rms_norm(qk, self.weight, self.eps)
