"""Triton kernel: SiLU-and-mul over a fused [gate | up] projection, in one pass.

out[t, i] = silu(x[t, i]) * x[t, I + i] for x [T, 2I]. Numerics as torch computes `F.silu(gate) * up`
in the activation dtype: silu in float32 rounded to that dtype, then the product rounded again (no-ops
in float32). Grid: (rows, column blocks of BLOCK_N).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import LazyKernel, check_device, next_power_of_2, require_triton

# Bound to `triton.language` by LazyKernel at first launch; importing this module never imports triton.
tl: Any = None


def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=mask)


_kernel = LazyKernel(_silu_and_mul_kernel)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (contiguous last dim) -> silu(x[:, :I]) * x[:, I:], a new [T, I] tensor."""
    require_triton()
    check_device(x)
    assert x.dim() == 2 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1, "x must be [T, 2I], last dim contiguous"
    rows, n_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n_cols), dtype=x.dtype, device=x.device)
    if rows == 0 or n_cols == 0:
        return out
    block_n = min(1024, next_power_of_2(n_cols))
    _kernel[(rows, -(-n_cols // block_n))](
        x, out, x.stride(0), out.stride(0), n_cols, BLOCK_N=block_n, num_warps=4 if block_n >= 512 else 1
    )
    return out
