"""Triton RMSNorm kernels: plain, and fused with the residual add (in place, as vLLM's fused_add_rms_norm).

Grid: one program per row; the whole row is one BLOCK_N tile (BLOCK_N = next power of two >= hidden),
read once, reduced in float32, written once.

Numerics follow Hugging Face's LlamaRMSNorm in every dtype (the torch references in
`kernels/rms_norm_ref.py` spell them out): the residual sum is rounded to the activation dtype before it
is normalised, `x * rsqrt(mean(x^2) + eps)` is computed in float32 and rounded to the activation dtype,
and only then multiplied by the weight (rounded again). In float32 every rounding is a no-op.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import LazyKernel, check_device, next_power_of_2, require_triton

# Bound to `triton.language` by LazyKernel at first launch; importing this module never imports triton.
tl: Any = None


def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    weight_ptr,
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


_kernel = LazyKernel(_rms_norm_kernel)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor, weight: torch.Tensor,
            eps: float) -> None:
    require_triton()
    check_device(x)
    n_cols = x.shape[-1]
    rows = x.numel() // n_cols
    if rows == 0:
        return
    for t in (x, out, *(() if residual is None else (residual,))):
        assert t.dim() == 2 and t.stride(-1) == 1, "rows must be 2-D with a contiguous last dim"
    assert weight.shape == (n_cols,) and weight.is_contiguous(), "weight must be [hidden] and contiguous"
    block_n = next_power_of_2(n_cols)
    _kernel[(rows,)](
        x,
        out if residual is None else residual,
        out,
        weight,
        x.stride(0),
        out.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        num_warps=min(16, max(1, block_n // 512)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) over the last dim of x [T, N] (last dim contiguous); a new tensor."""
    out = torch.empty((x.shape[0], x.shape[-1]), dtype=x.dtype, device=x.device)
    _launch(x, None, out, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- x + residual; x <- weight * normalise(residual). x, residual [T, N]."""
    assert x.shape == residual.shape and x.dtype == residual.dtype, "x and residual must match"
    _launch(x, residual, x, weight, eps)
