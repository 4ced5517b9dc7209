"""What one linear call costs on CPU, by path: tandem's packed oneDNN linear
(`torch.ops.mkldnn._linear_pointwise` on a `_reorder_linear_weight`-packed weight, engine_svc/model/layers/
cpu_gemm.py) against `torch.nn.functional.linear` on the plain weight, at SmolLM2-135M's shapes and a tiny
one that shows the per-call set-up alone. Best of 3 rounds, alternating paths.

    OMP_NUM_THREADS=1 python bench/cpu_linear_call.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine_svc.model.layers import cpu_gemm

# (rows, in, out): the set-up alone, o_proj at batch 1, gate_up at 16 rows, down at 64, the LM head at 1
SHAPES = ((1, 64, 64), (1, 576, 576), (16, 576, 3072), (64, 1536, 576), (1, 576, 49152))


def _us_per_call(fn: Callable[..., object], reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"{args.dtype}, {torch.get_num_threads()} thread(s)")
    print("| rows x in -> out | packed µs | F.linear µs | packed / F.linear |")
    print("|---|---|---|---|")
    for rows, k, n in SHAPES:
        weight, x = torch.randn(n, k, dtype=dtype), torch.randn(rows, k, dtype=dtype)
        packed = cpu_gemm.pack_weight(weight)
        paths = {"packed": lambda x=x, p=packed: cpu_gemm.packed_linear(x, p, None),
                 "F.linear": lambda x=x, w=weight: torch.nn.functional.linear(x, w)}
        reps = 20 if n * k > 10_000_000 else 200
        best = {name: min(_us_per_call(fn, reps) for _ in range(2)) for name, fn in paths.items()}  # warm-up
        for _ in range(args.rounds):
            for name, fn in paths.items():
                best[name] = min(best[name], _us_per_call(fn, reps))
        print(f"| {rows} x {k} -> {n} | {best['packed']:.1f} | {best['F.linear']:.1f} | "
              f"{best['packed'] / best['F.linear']:.2f} |")


if __name__ == "__main__":
    main()
