"""Triton kernel: the LoRA expand of a mixed batch, out += xa @ B_slot per token and sub-projection
(punica's / vLLM's lora_expand with add_inputs).

`lora_expand(xa [T, P*R] float32, b [S, R, O], out [T, O], mapping, offsets, max_width)`: for every token
t on slot s (kernels/lora_mapping.py) and sub-projection p (columns offsets[p] .. offsets[p+1] of `out`:
q | k | v, gate | up, or the whole output), out[t, cols of p] += xa[t, p*R:(p+1)*R] @ b[s, :, cols of p],
summed in float32 and rounded once to out's dtype. One launch for every slot and sub-projection: program
(m, n, p, s) owns BLOCK_M of slot s's tokens and a BLOCK_N tile of p's columns, so every output element
is read and written by exactly one program (in place, no atomics). Base-model tokens' rows are never
touched. `offsets` is a device tensor [P+1] int32 and `max_width` the widest sub-projection (a host int
fixed per layer), so the grid depends on T, P and S only: CUDA-graph safe.

Numerics equal kernels/lora_ref.py's `lora_expand` up to float32 summation order.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._triton import LazyKernel, check_device, next_power_of_2, require_triton
from kernels.lora_mapping import LoRAMapping

# Bound to `triton.language` by LazyKernel at first launch; importing this module never imports triton.
tl: Any = None


def _expand(
    xa_ptr, b_ptr, out_ptr, sorted_ptr, count_ptr, start_ptr, offsets_ptr,
    RANK, MAX_WIDTH, stride_xam, stride_bs, stride_bk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[rows, cols] += xa[rows, p*R:(p+1)*R] . b[slot, :, cols] for one tile of sub-projection p."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    slot = tl.program_id(2)
    num_n_tiles = tl.cdiv(MAX_WIDTH, BLOCK_N)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    col0 = tl.load(offsets_ptr + part)
    width = tl.load(offsets_ptr + part + 1) - col0
    if pid_n * BLOCK_N >= width:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(sorted_ptr + tl.load(start_ptr + slot) + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < width
    cols = (col0 + offs_n).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < RANK
    xa = tl.load(xa_ptr + rows[:, None] * stride_xam + part * RANK + offs_k[None, :],
                 mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_k[:, None] * stride_bk + cols[None, :],
                mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    acc = tl.dot(xa, b, input_precision="ieee")
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    acc += tl.load(out_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


_kernel = LazyKernel(_expand)

BLOCK_M = 16


def lora_expand(xa: torch.Tensor, b: torch.Tensor, out: torch.Tensor, mapping: LoRAMapping,
                offsets: torch.Tensor, max_width: int) -> torch.Tensor:
    """Add each adapter token's xa @ B_slot into `out`'s sub-projection columns, in place; returns `out`."""
    require_triton()
    check_device(out)
    tokens = out.shape[0]
    num_slots, rank, _ = b.shape
    parts = offsets.numel() - 1
    assert xa.dtype == torch.float32 and xa.shape == (tokens, parts * rank) and xa.stride(1) == 1, \
        "xa must be [T, P*R] float32"
    assert out.stride(1) == 1 and b.stride(2) == 1, "out and b must be contiguous in their last dim"
    if tokens == 0:
        return out
    block_n = min(64, max(16, next_power_of_2(max_width)))
    block_k = max(16, next_power_of_2(rank))
    grid = (-(-tokens // BLOCK_M) * -(-max_width // block_n), parts, num_slots)
    _kernel[grid](
        xa, b, out, mapping.sorted_tokens, mapping.counts, mapping.starts, offsets,
        rank, max_width, xa.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
