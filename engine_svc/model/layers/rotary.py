"""Rotary position embedding (GPT-NeoX / HF "rotate half" style), from a precomputed cache.

The cache holds, per position p, `cos(p * f)` and a *signed* sine `[-sin(p * f), sin(p * f)]` over the
full head_dim (frequencies repeated for both halves), so that

    rope(x) = x * cos + roll(x, head_dim / 2) * signed_sin

equals HF's `x * cos + rotate_half(x) * sin` in three ops per call.

The fused Triton path (`kernels/rope.py`, used with the Triton attention backend) reads the same cache by
position inside one kernel per layer, so the model then skips the per-forward gather: see
`RotaryEmbedding.inputs`.

Positions must be < max_position (the cache's rows). The model runner guarantees it on the host
(max_model_len <= max_position); CPU lookups also check it, so a bad position is a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def read_rope_config(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, rope parameters) from either transformers 5.x `rope_parameters` or the older
    `rope_theta` + `rope_scaling` attributes. The returned dict always has a "rope_type"."""
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return float(theta), params


def _inverse_frequencies(head_dim: int, theta: float, params: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    if rope_type == "yarn":
        return _yarn(head_dim, theta, params)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn)")


def _yarn(head_dim: int, theta: float, params: dict[str, Any]) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies blended between the original (short wavelengths, extrapolated) and
    divided by `factor` (long ones, interpolated) over a linear ramp between the dims that turn beta_fast
    and beta_slow times within original_max_position_embeddings (floored / ceiled when `truncate`)."""
    if "original_max_position_embeddings" not in params:
        raise ValueError("rope_type yarn needs rope_scaling.original_max_position_embeddings")
    factor, original = float(params["factor"]), float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def attention_factor(params: dict[str, Any]) -> float:
    """What cos and sin are multiplied by: YaRN's 0.1 ln(factor) + 1 (or its `attention_factor`), else 1."""
    if params.get("rope_type") != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all:
        return get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all))
    return get_mscale(factor)


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    interpolation in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


@dataclass
class RotaryInputs:
    """What the layers of one forward need to rotate q/k: the positions and the cache (fused kernel),
    plus, on the torch path, the cache rows gathered once for all layers (cos, signed sin [T, 1, D])."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """cos/sin cache of shape [max_position, 2, head_dim] in the model dtype (computed in float32)."""

    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float = 10000.0,
        rope_params: dict[str, Any] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        params = dict(rope_params or {})
        params.setdefault("rope_type", "default")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = _inverse_frequencies(head_dim, rope_theta, params)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        scale = attention_factor(params)
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1) * scale
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * scale
        cache = torch.stack((cos, sin), dim=1).to(dtype or torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed_sin), each [T, 1, head_dim], broadcastable over heads."""
        if positions.device.type == "cpu":  # free on CPU; on a GPU it would cost a sync
            self.check_positions(int(positions.max()) if positions.numel() else 0)
        both = self.cos_sin_cache.index_select(0, positions)
        return both[:, 0:1], both[:, 1:2]

    def inputs(self, positions: torch.Tensor, *, gather: bool) -> RotaryInputs:
        """Rotation inputs for one forward; `gather` precomputes cos/sin rows for the torch path."""
        if not gather:
            return RotaryInputs(positions, self.cos_sin_cache)
        cos, sin = self.cos_sin(positions)
        return RotaryInputs(positions, self.cos_sin_cache, cos, sin)

    def check_positions(self, max_position: int) -> None:
        """ValueError unless `max_position` has a row in the cache."""
        if max_position >= self.max_position:
            raise ValueError(
                f"position {max_position} is outside the rotary cache, which covers positions "
                f"0..{self.max_position - 1} (the model's max_position_embeddings); sequences must be "
                "no longer than that"
            )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, head_dim] with (cos, signed_sin) from `RotaryEmbedding.cos_sin` -> rotated copy of x."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
