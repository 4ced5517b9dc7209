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
`--fused` also times the fused small ops of each source that binds them (cpu_fused_ops.cpp beside it) at
the decode batch's rows, SmolLM2-135M's sizes: SiLU-and-mul of [decodes, 2 x 1536], add + RMSNorm of
[decodes, 576], RoPE of the 12 q/k heads of a [decodes, 15, 64] qkv view (median of 7 x 50 calls each).

    python bench/cpu_decode_op.py --decodes 16 --context 160 --fused /tmp/old/cpu_paged_decode.cpp \
        engine_svc/attention/csrc/cpu_paged_decode.cpp
"""

from __future__ import annotations

import argparse
import functools
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
    ap.add_argument("--fused", action="store_true", help="also time the fused small ops")
    args = ap.parse_args()
    runs = []  # (label, paged_decode)
    modules = []
    for source in args.sources:
        mod = build(source)
        modules.append((source, mod))
        runs.append((source, mod.paged_decode))  # type: ignore[attr-defined]
        if hasattr(mod, "paged_decode_portable"):
            runs.append((f"{source} (portable)", mod.paged_decode_portable))
    time_runs(runs, args.decodes, args.context)
    if args.fused:
        time_fused([(s, m) for s, m in modules if hasattr(m, "silu_and_mul")], args.decodes)


def _median_us(call: Any, reps: int = 50) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        times.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(times)


def time_fused(modules: list[tuple[str, Any]], rows: int) -> None:
    """Each module's SiLU-and-mul, add + RMSNorm and RoPE at `rows` decode rows; results must be equal."""
    gen = torch.Generator().manual_seed(0)
    angles = torch.arange(4096)[:, None] * torch.rand(32, generator=gen)
    cos, sin = angles.cos().repeat(1, 2), angles.sin()
    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.stack([cos, torch.cat([-sin, sin], 1)], 1).to(dtype)  # [P, 2, D]: cos, signed sin
        gate_up = torch.randn(rows, 2 * 1536, generator=gen).to(dtype)
        hidden, residual = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
        weight = torch.rand(576, generator=gen).to(dtype) + 0.5
        qkv = torch.randn(rows, 15, 64, generator=gen).to(dtype)
        positions = torch.randint(0, 4096, (rows,), generator=gen)
        results = []
        for source, mod in modules:
            h, r, q = hidden.clone(), residual.clone(), qkv.clone()
            silu = _median_us(functools.partial(mod.silu_and_mul, gate_up))
            norm = _median_us(functools.partial(mod.add_rms_norm_, h, r, weight, 1e-5))
            rope = _median_us(functools.partial(mod.rotary_, q[:, :12], positions, cache))
            h, r, q = hidden.clone(), residual.clone(), qkv.clone()
            mod.add_rms_norm_(h, r, weight, 1e-5)
            mod.rotary_(q[:, :12], positions, cache)
            results.append((mod.silu_and_mul(gate_up), h, r, q))
            print(f"{dtype} {source}: silu_and_mul {silu:.1f} us, add_rms_norm_ {norm:.1f} us, rotary_ {rope:.1f} us")
        for (source, _), got in zip(modules[1:], results[1:]):
            same = all(torch.equal(a, b) for a, b in zip(got, results[0]))
            print(f"  {source}: results {'equal to' if same else 'DIFFER from'} the first's")


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
