"""The fused MoE Triton kernel against a grouped torch baseline, on a GPU.

Usage (GPU only): python bench/kernel_moe.py [--tokens 1 8 32 128 512 2048] [--shape qwen3-30b-a3b bench]

For each expert shape and step size (tokens, each routed to top-k of E experts by a random softmax):
- `fused_moe`: kernels/fused_moe.py (align, one grouped GEMM for gate/up, SiLU-and-mul, one for down, sum);
- `grouped torch`: the same work in torch - the slots sorted by expert, `torch._grouped_mm` for gate/up and
  for down over the sorted rows (empty groups skipped), SiLU-and-mul, the weighted rows summed per token
  with `index_add_` (the fastest stock-torch expert GEMM there is; where `_grouped_mm` is missing, a loop
  over the experts that received rows).
Both are timed eager (CUDA events around each call, median), and their outputs compared with the torch
reference (kernels/fused_moe_ref.py, max abs diff). Printed: milliseconds, the weight bytes the step must
read (every expert that received a row, once) over the kernel's time as GB/s, and grouped / fused.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from kernels.fused_moe import fused_experts
from kernels.fused_moe_ref import fused_experts as reference

# name -> (hidden, experts, expert intermediate, top-k)
SHAPES = {"qwen3-30b-a3b": (2048, 128, 768, 8), "bench": (1024, 64, 256, 8)}


def grouped_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The experts in stock torch: rows sorted by expert, one grouped GEMM each way."""
    num_experts, top_k = w13.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    rows = x[tokens]
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    inter = w2.shape[2]
    if hasattr(torch, "_grouped_mm"):
        h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offsets)
    else:  # pragma: no cover - older torch
        y = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                h = F.linear(rows[start:start + n], w13[e])
                y[start:start + n] = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e])
                start += n
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)


def time_ms(fn: Callable[[], torch.Tensor], reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048])
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev, dtype = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, bfloat16, eager, median of 30 calls")
    print("| shape | tokens | experts hit | fused_moe ms | GB/s | grouped torch ms | grouped / fused | max diff vs ref |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shape:
        hidden, num_experts, inter, top_k = SHAPES[name]
        gen = torch.Generator(device=dev).manual_seed(0)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=dev) / hidden**0.5).to(dtype)
        w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=dev) / inter**0.5).to(dtype)
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=gen, device=dev).to(dtype)
            probs = torch.softmax(torch.randn(tokens, num_experts, generator=gen, device=dev), dim=-1)
            weights, ids = torch.topk(probs, top_k, dim=-1)
            hit = int(torch.unique(ids).numel())
            step = (x, w13, w2, weights, ids)
            fused_ms = time_ms(lambda step=step: fused_experts(*step))
            grouped_ms = time_ms(lambda step=step: grouped_torch(*step))
            want = reference(*step).float()
            diff = max(float((fused_experts(*step).float() - want).abs().max()),
                       float((grouped_torch(*step).float() - want).abs().max()))
            weight_bytes = hit * (w13[0].numel() + w2[0].numel()) * w13.element_size()
            print(f"| {name} | {tokens} | {hit} | {fused_ms:.3f} | {weight_bytes / fused_ms / 1e6:.0f} "
                  f"| {grouped_ms:.3f} | {grouped_ms / fused_ms:.2f}x | {diff:.3g} |", flush=True)


if __name__ == "__main__":
    main()
