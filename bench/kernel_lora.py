"""The LoRA shrink/expand Triton kernels against the torch one-hot path they replace, on a GPU.

Usage (GPU only): python bench/kernel_lora.py [--tokens 1 32 256 2048] [--slots 8] [--rank 16]

For the fused qkv projection of a model shape (Llama-3-8B: hidden 4096, q 4096, k/v 1024; SmolLM2-135M:
576, 576, 192), each step size's tokens spread round-robin over --slots adapters of --rank, bfloat16:
- `kernels`: kernels/lora_shrink.py then kernels/lora_expand.py (one launch each);
- `torch one-hot`: engine_svc/lora/slots.py's torch path (every token times every slot's A, masked, one
  GEMM through the block-diagonal B).
Both timed eager (bench/kernel_moe.py's CUDA-event timer, median of 50), outputs compared (max abs diff). Printed: microseconds, the
bytes the kernels must move (each used slot's A and B once, x, xa twice, out twice) over their time as
GB/s, and torch / kernels.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch
from kernel_moe import time_ms

from engine_svc.lora.slots import LoRASlots, StepLoRA

SHAPES = {"llama3-8b": (4096, [4096, 1024, 1024]), "smollm2-135m": (576, [576, 192, 192])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256, 2048])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    for name, (d_in, subs) in SHAPES.items():
        steps = {True: StepLoRA(kernels=True, slots=args.slots, capacity=max(args.tokens), device=dev),
                 False: StepLoRA()}
        layers = {k: LoRASlots(step, args.slots, args.rank, d_in, subs, dtype, dev) for k, step in steps.items()}
        width, d_out = args.rank * len(subs), sum(subs)
        for s in range(args.slots):
            a = torch.randn(width, d_in, device=dev) / d_in**0.5
            b = torch.zeros(width, d_out, device=dev)
            col = 0
            for p, size in enumerate(subs):
                b[p * args.rank : (p + 1) * args.rank, col : col + size] = torch.randn(args.rank, size, device=dev)
                col += size
            for layer in layers.values():
                layer.load(s, a, b)
        print(f"{name}: qkv {d_in} -> {subs}, {args.slots} slots, rank {args.rank}, bfloat16")
        for tokens in args.tokens:
            token_slots = np.arange(tokens) % args.slots
            for step in steps.values():
                step.plan(token_slots, dtype, dev)
            x = torch.randn(tokens, d_in, device=dev, dtype=dtype)
            base = torch.randn(tokens, d_out, device=dev, dtype=dtype)
            outs = {k: layer(x, base.clone()) for k, layer in layers.items()}
            diff = (outs[True].float() - outs[False].float()).abs().max().item()
            t_kernel = 1000 * time_ms(lambda layer=layers[True], x=x, base=base: layer(x, base), reps=50)
            t_torch = 1000 * time_ms(lambda layer=layers[False], x=x, base=base: layer(x, base), reps=50)
            used = min(tokens, args.slots)
            moved = (used * (width * d_in + args.rank * d_out) * 2 + tokens * d_in * 2 + 2 * tokens * width * 4
                     + 2 * tokens * d_out * 2)
            print(f"  tokens {tokens:5d}: kernels {t_kernel:8.1f} us ({moved / t_kernel / 1e3:7.1f} GB/s)  "
                  f"torch one-hot {t_torch:8.1f} us  torch/kernels {t_torch / t_kernel:5.2f}x  max diff {diff:.3g}")


if __name__ == "__main__":
    main()
