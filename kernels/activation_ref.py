"""Torch reference for `kernels.activation.silu_and_mul` (same signature, same result)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
