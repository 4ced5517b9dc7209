"""The native CPU paged decode kernel built from several C++ sources, side by side in one process.

Builds each source (a copy of engine_svc/attention/csrc/cpu_paged_decode.cpp, old or new; the directory
of the source must hold cpu_math.h, and cpu_fused_ops.cpp when the source binds the fused ops) as its own extension, then times `paged_decode`
on 64 decodes with contexts uniform in [128, 256] (`--decodes`, `--context`: [context / 2, context]), SmolLM2-135M's 9 query / 3 KV heads, D 64, 16-token
blocks, in bfloat16 and float32 (median of 7 x 10 calls), and prints each result's largest difference
from the first source's.

    git show main:engine_svc/attention/csrc/cpu_paged_decode.cpp > /tmp/old.cpp
    python bench/cpu_decode_op.py /tmp/old.cpp engine_svc/attention/csrc/cpu_paged_decode.cpp
    python bench/cpu_decode_op.py --decodes 16 --context 384 /tmp/old.cpp engine_svc/attention/csrc/cpu_paged_decode.cpp

A source that binds `paged_decode_portable` is timed on that path too (bfloat16 without AVX512-BF16).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import cpp_extension

B, H, HKV, D, BS, CTX = 64, 9, 3, 64, 16, 256


def build(source: str) -> object:
    """The source as an extension, with the fused ops' source beside it when it binds them."""
    text = Path(source).read_bytes()
    sources = [source]
    if b"cpu_fused_ops.cpp" in text:
        sources.append(str(Path(source).with_name("cpu_fused_ops.cpp")))
    digest = hashlib.sha1(text).hexdigest()[:10]
    return cpp_extension.load(f"decode_bench_{digest}", sources, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                              extra_ldflags=["-fopenmp"])


def main() -> None:
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+")
    ap.add_argument("--decodes", type=int, default=B)
    ap.add_argument("--context", type=int, default=CTX)
    args = ap.parse_args()
    runs = []  # (label, paged_decode)
    for source in args.sources:
        mod = build(source)
        runs.append((source, mod.paged_decode))  # type: ignore[attr-defined]
        if hasattr(mod, "paged_decode_portable"):
            runs.append((f"{source} (portable)", mod.paged_decode_portable))
    time_runs(runs, args.decodes, args.context)


def time_runs(runs: list[tuple[str, Any]], B: int, CTX: int) -> None:
    """Time each run on one batch per dtype; print each result's largest difference from the first's."""
    torch.manual_seed(0)
    num_blocks = B * CTX // BS + 8
    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.randn(2, num_blocks, HKV, BS, D).to(dtype)
        table = torch.randperm(num_blocks)[: B * CTX // BS].view(B, -1).to(torch.int32)
        lens = torch.randint(CTX // 2, CTX + 1, (B,), dtype=torch.int32)
        query = torch.randn(B, H + 2 * HKV, D).to(dtype)[:, :H]  # a view of a qkv projection, as the model passes
        outs = []
        for source, decode in runs:
            for _ in range(3):
                decode(query, cache, table, lens, D**-0.5)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                for _ in range(10):
                    out = decode(query, cache, table, lens, D**-0.5)
                times.append((time.perf_counter() - start) / 10 * 1e3)
            outs.append(out.float())
            print(f"{dtype} {source}: {statistics.median(times):.3f} ms per call (min {min(times):.3f})")
        for (source, _), out in zip(runs[1:], outs[1:]):
            print(f"  {source}: max |diff| from the first {(out - outs[0]).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
