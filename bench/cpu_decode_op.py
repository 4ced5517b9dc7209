"""The native CPU paged decode kernel built from several C++ sources, side by side in one process.

Builds each source (a copy of engine_svc/attention/csrc/cpu_paged_decode.cpp, old or new; the directory
of the source must hold cpu_math.h, and cpu_fused_ops.cpp when the source binds the fused ops) as its own extension, then times `paged_decode`
on 64 decodes with contexts uniform in [128, 256], SmolLM2-135M's 9 query / 3 KV heads, D 64, 16-token
blocks, in bfloat16 and float32 (median of 7 x 10 calls), and prints each result's largest difference
from the first source's.

    git show main:engine_svc/attention/csrc/cpu_paged_decode.cpp > /tmp/old.cpp
    python bench/cpu_decode_op.py /tmp/old.cpp engine_svc/attention/csrc/cpu_paged_decode.cpp
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

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
    sources = sys.argv[1:]
    mods = [build(s) for s in sources]
    torch.manual_seed(0)
    num_blocks = B * CTX // BS + 8
    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.randn(2, num_blocks, HKV, BS, D).to(dtype)
        table = torch.randperm(num_blocks)[: B * CTX // BS].view(B, -1).to(torch.int32)
        lens = torch.randint(CTX // 2, CTX + 1, (B,), dtype=torch.int32)
        query = torch.randn(B, H + 2 * HKV, D).to(dtype)[:, :H]  # a view of a qkv projection, as the model passes
        outs = []
        for source, mod in zip(sources, mods):
            for _ in range(3):
                mod.paged_decode(query, cache, table, lens, D**-0.5)  # type: ignore[attr-defined]
            times = []
            for _ in range(7):
                start = time.perf_counter()
                for _ in range(10):
                    out = mod.paged_decode(query, cache, table, lens, D**-0.5)  # type: ignore[attr-defined]
                times.append((time.perf_counter() - start) / 10 * 1e3)
            outs.append(out.float())
            print(f"{dtype} {source}: {statistics.median(times):.3f} ms per call (min {min(times):.3f})")
        for source, out in zip(sources[1:], outs[1:]):
            print(f"  {source}: max |diff| from the first {(out - outs[0]).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
