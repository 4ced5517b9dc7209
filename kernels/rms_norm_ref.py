"""Torch references for `kernels.rms_norm` (same signatures, same effects), written as Hugging Face's
LlamaRMSNorm computes: float32 statistics, the normalised value rounded to the input dtype, then the
weight multiply in that dtype."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) over the last dim; `weight` broadcasts against x ([N], or e.g. [H, N])."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- x + residual; x <- weight * normalise(residual)."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))
