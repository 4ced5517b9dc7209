"""Triton kernels: the experts of a MoE layer as two grouped GEMM launches (vLLM's fused_moe design).

`fused_experts(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K])` does:
1. `moe_align_block_size`: the T*K (token, choice) slots sorted by expert and padded so that every block of
   BLOCK_M sorted slots belongs to one expert (`sorted_ids`: slot index, or T*K for padding;
   `block_expert`: each block's expert, -1 past the end). Torch ops on the device, no host sync: the
   grid is sized for the worst case (every expert's last block padded) and unused blocks exit at once.
2. One launch of `_moe_gemm` for gate/up: each program multiplies BLOCK_M sorted slots' hidden rows (row
   slot // K) by a BLOCK_N tile of their expert's w13, writing cache1 [T*K, 2I] by slot.
3. The gated activation (the SiLU-and-mul kernel, or torch for the others) -> cache2 [T*K, I].
4. One launch of `_moe_gemm` for down: cache2 rows by slot times w2[expert], each result rounded to the
   weight dtype (as a torch linear's output is), then multiplied by its routing weight in float32 into
   cache3 [T*K, H] (float32; slots of experts marked -1 stay zero).
5. cache3 summed over the K choices in float32, rounded once to the activation dtype.

Numerics equal kernels/fused_moe_ref.py (one expert at a time in torch) up to float32 summation order.
Experts that receive no slot cost nothing (no block names them); an expert that receives every slot just
gets more blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import activation as triton_activation
from kernels._triton import LazyKernel, check_device, interpret_mode, next_power_of_2, require_triton
from kernels.fused_moe_ref import gated_activation

# Bound to `triton.language` by LazyKernel at first launch; importing this module never imports triton.
tl: Any = None


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [P] int32, block_expert [P / block_m] int32, num_padded [1] int32) for `topk_ids`
    [T, K] (ids < 0: not held here, left out). P = T*K + E*(block_m - 1) rounded up to block_m, the most
    any routing needs. Device ops only, no host sync (CUDA-graph safe). Slots of one expert keep their order; expert e's slots start at a multiple of
    block_m; entries past an expert's slots (and past `num_padded`) hold T*K."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    dev = flat.device
    key = torch.where(flat >= 0, flat, num_experts)  # slots not held here sort last, into bucket E
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync, no CUDA graphs)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    dest = padded_start[sorted_key] + torch.arange(num_slots, device=dev) - count_start[sorted_key]
    capacity = -(-(num_slots + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity + 1,), num_slots, dtype=torch.int32, device=dev)
    # slots of bucket E go to the spare last entry (dropped below)
    dest = torch.where(sorted_key < num_experts, dest, capacity)
    sorted_ids.index_put_((dest,), order.to(torch.int32))
    sorted_ids = sorted_ids[:capacity]
    block_starts = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end[:num_experts], block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_padded = padded_end[num_experts - 1 : num_experts].to(torch.int32)
    return sorted_ids, block_expert, num_padded


def _moe_gemm(
    a_ptr, b_ptr, c_ptr, bias_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_slots,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_bias_e,
    ROWS_PER_A: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[slot, n] = A[slot // ROWS_PER_A, :] . B[expert, n, :] (+ bias[expert, n]) for one BLOCK_M x BLOCK_N
    tile of sorted slots; with MUL_WEIGHT the result is rounded to B's dtype, then times weight[slot]."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ids_ptr + offs_m)
    slot_ok = slots < num_slots
    rows = (slots // ROWS_PER_A).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k_tile * BLOCK_K
        a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if MUL_WEIGHT:
        weight = tl.load(weight_ptr + slots, mask=slot_ok, other=0.0).to(tl.float32)
        acc = acc.to(b_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=slot_ok[:, None] & n_ok[None, :])


_kernel = LazyKernel(_moe_gemm)


def choose_block_m(num_slots: int, num_experts: int) -> int:
    """Rows per block: 16 while experts get few slots each (decode), up to 64 for long prefills."""
    per_expert = num_slots / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
          weights: torch.Tensor | None, align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
          rows_per_a: int, block_m: int) -> None:
    sorted_ids, block_expert, num_padded = align
    n, k = b.shape[1], b.shape[2]
    block_n = min(64, max(16, next_power_of_2(n)))
    block_k = min(64, max(16, next_power_of_2(k)))
    dot_in_fp32 = b.dtype == torch.bfloat16 and interpret_mode()
    grid = (block_expert.numel() * -(-n // block_n),)
    _kernel[grid](
        a, b, c, c if bias is None else bias, c if weights is None else weights,
        sorted_ids, block_expert, num_padded,
        n, k, c.shape[0],
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0), 0 if bias is None else bias.stride(0),
        ROWS_PER_A=rows_per_a, HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        DOT_PRECISION="ieee" if b.dtype == torch.float32 or dot_in_fp32 else "tf32", DOT_IN_FP32=dot_in_fp32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """The weighted sum of each token's chosen experts, [T, H]; see the module docstring and
    kernels/fused_moe_ref.py (same signature and numerics)."""
    require_triton()
    check_device(hidden)
    assert hidden.dim() == 2 and hidden.stride(-1) == 1, "hidden must be [T, H], last dim contiguous"
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, "expert weights must be contiguous in their last dim"
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    hidden_size = w2.shape[1]
    out_sum = torch.zeros((num_slots, hidden_size), dtype=torch.float32, device=hidden.device)
    if num_slots == 0:
        return torch.zeros((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    block_m = choose_block_m(num_slots, w13.shape[0])
    align = moe_align_block_size(topk_ids, block_m, w13.shape[0])
    gate_up = torch.empty((num_slots, w13.shape[1]), dtype=hidden.dtype, device=hidden.device)
    _gemm(hidden, w13, gate_up, w13_bias, None, align, top_k, block_m)
    if activation == "silu":
        act = triton_activation.silu_and_mul(gate_up)
    else:
        act = gated_activation(gate_up, activation, swiglu_alpha, swiglu_limit)
    weights = topk_weights.reshape(-1).to(torch.float32)
    _gemm(act, w2, out_sum, w2_bias, weights, align, 1, block_m)
    return out_sum.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
