"""Triton kernel: the LoRA shrink of a mixed batch, xa = x @ A_slot^T per token (punica's / vLLM's lora_shrink).

`lora_shrink(x [T, in], a [S, W, in], xa [T, W] float32, mapping)` writes, for every token t on slot s
(kernels/lora_mapping.py), xa[t] = x[t] @ a[s]^T accumulated in float32; rows of base-model tokens are
not written. One launch for all slots and all sub-projections (their A's are stacked along W): program
(m, n, s) multiplies BLOCK_M of slot s's tokens (gathered through `mapping.sorted_tokens`) by a BLOCK_N
tile of a[s]. The grid is sized by T and S only (no host read of the mapping), so a launch is the same
for every step of one batch size and can be captured in a CUDA graph; programs past a slot's token count
exit at once.

Numerics equal kernels/lora_ref.py's `lora_shrink` up to float32 summation order.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import LazyKernel, check_device, interpret_mode, next_power_of_2, require_triton
from kernels.lora_mapping import LoRAMapping

# Bound to `triton.language` by LazyKernel at first launch; importing this module never imports triton.
tl: Any = None


def _shrink(
    x_ptr, a_ptr, xa_ptr, sorted_ptr, count_ptr, start_ptr,
    N, K, stride_xm, stride_as, stride_an, stride_xam,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """xa[rows, n tile] = x[rows] . a[slot, n tile]^T for one BLOCK_M block of slot `program_id(1)`'s tokens."""
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(sorted_ptr + tl.load(start_ptr + slot) + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + offs_n[None, :].to(tl.int64) * stride_an + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k_tile * BLOCK_K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    xa_ptrs = xa_ptr + rows[:, None] * stride_xam + offs_n[None, :]
    tl.store(xa_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


_kernel = LazyKernel(_shrink)

BLOCK_M = 16


def lora_shrink(x: torch.Tensor, a: torch.Tensor, xa: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """Write xa [T, W] (float32) = each adapter token's x times its slot's A^T; see the module docstring."""
    require_triton()
    check_device(x)
    tokens, k = x.shape
    num_slots, n, _ = a.shape
    assert x.stride(1) == 1 and a.stride(2) == 1, "x and a must be contiguous in their last dim"
    assert xa.dtype == torch.float32 and xa.shape == (tokens, n) and xa.stride(1) == 1, "xa must be [T, W] float32"
    if tokens == 0:
        return xa
    block_n = min(64, max(16, next_power_of_2(n)))
    block_k = min(64, max(16, next_power_of_2(k)))
    dot_in_fp32 = x.dtype != torch.float32 and interpret_mode()
    grid = (-(-tokens // BLOCK_M) * -(-n // block_n), num_slots)
    _kernel[grid](
        x, a, xa, mapping.sorted_tokens, mapping.counts, mapping.starts,
        n, k, x.stride(0), a.stride(0), a.stride(1), xa.stride(0),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or dot_in_fp32 else "tf32", DOT_IN_FP32=dot_in_fp32,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return xa
