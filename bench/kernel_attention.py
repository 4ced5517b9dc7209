"""Decode-attention bandwidth benchmark: the Triton paged kernel vs torch SDPA on contiguous K/V.

Usage (GPU only): python bench/kernel_attention.py [--contexts 1024 4096 16384] [--batches 1 4 16 64 128 256]

1. Measures achievable HBM bandwidth with a large device-to-device copy (bytes read + written / time).
2. For each context length and batch size: decode (q_len 1), bf16, 8 KV heads, GQA 2 (16 query heads),
   head_dim 128, block_size 16, every request's blocks scattered through a shuffled cache. Reports time,
   effective bandwidth = (K + V of all contexts + q) / time, and its share of the measured HBM bandwidth,
   for the paged Triton kernel and for SDPA over the same data laid out contiguously [B, Hkv, L, D].
   The two outputs are compared (max abs diff) so a wrong kernel cannot post a good number.
3. Two timings per kernel:
   - graph (the default table): the call replayed from a CUDA graph, as decode steps run in the
     engine, over enough independent copies of the data (>= L2_FLUSH_BYTES in all) that the L2 cache
     cannot serve a call from the previous one; no host launch cost is included;
   - eager (`triton.testing.do_bench`): includes Python/host launch overhead, which dominates small
     batches (a Triton launch costs tens of microseconds of host time; the batch-1 4k data moves in ~6 us).
Prints a markdown table.

`--sweep` instead searches the decode launch shape (keys per inner step, warps, pipeline stages) over a
fixed set of decode shapes, graph-timed as above: first tile x warps at triton's default stages, then the
stages for the best pair. A config is scored by the geometric mean of its speed-up over the kernel's
current default across the shapes; its outputs must match the default's. `--best-out FILE` writes the
winner as `tile=..,warps=..,stages=..`, the form TANDEM_DECODE_ATTENTION takes.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 8, 2, 128, 16
DTYPE = torch.bfloat16
L2_FLUSH_BYTES = 256 << 20  # several times an H100/H200's 50-60 MB L2


def graph_ms(calls: list, reps: int = 20) -> float:
    """GPU milliseconds per call when `calls` (each on its own data) replay from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / len(calls)


def measure_hbm_bandwidth(do_bench, num_bytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy of `num_bytes` (counted as read + write)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * num_bytes / (ms * 1e-3)


def make_decode_batch(batch: int, context: int) -> dict[str, torch.Tensor]:
    """Paged cache (shuffled blocks), block table, query, and per-request lengths for a decode step."""
    blocks_per_req = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_req
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    table = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_req).to(torch.int32)
    query = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, dtype=DTYPE, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return dict(cache=cache, table=table, query=query, qsl=qsl, seq_lens=seq_lens)


def contiguous_kv(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contexts gathered into [B, Hkv, L, D] (what SDPA reads)."""
    batch, blocks = data["table"].shape
    shape = (batch, blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    index = data["table"].long()
    k = data["cache"][0, index].reshape(shape).transpose(1, 2).contiguous()  # one at a time: peak memory
    v = data["cache"][1, index].reshape(shape).transpose(1, 2).contiguous()
    return k, v


SWEEP_SHAPES = ((1024, 256), (4096, 1), (4096, 4), (4096, 16), (4096, 64), (4096, 256), (16384, 4), (16384, 16))
WORTH_A_CHANGE = 1.03  # a winner must beat the default by this factor (the graph timings repeat within ~1%)
SWEEP_TILES, SWEEP_WARPS, SWEEP_STAGES = (16, 32, 64, 128), (2, 4, 8), (1, 2, 3, 4)


def sweep(hbm: float, best_out: str | None) -> None:
    """Search (tile, warps, stages) for decode; print each config's score and per-shape % of HBM."""
    from kernels.paged_attention import unified_paged_attention

    scale = HEAD_DIM**-0.5
    shapes = []
    for context, batch in SWEEP_SHAPES:
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
        copies = max(1, min(64, -(-L2_FLUSH_BYTES // kv_bytes)))
        shapes.append((context, batch, kv_bytes, [make_decode_batch(batch, context) for _ in range(copies)]))

    def run(config: dict[str, int]) -> list[float] | None:
        times = []
        for context, batch, _, datas in shapes:
            def call(d, context=context):
                return unified_paged_attention(
                    d["query"], d["cache"], d["qsl"], d["seq_lens"], d["table"], scale, 1, context,
                    tile_size=config.get("tile"), num_warps=config.get("warps"), num_stages=config.get("stages"),
                )
            try:
                got = call(datas[0]).float()
            except Exception as exc:  # e.g. out of shared memory for a large tile with many stages
                print(f"  {config}: {type(exc).__name__}: {str(exc)[:120]}")
                return None
            want = reference.setdefault((context, batch), got)  # the first config run is the default
            if (got - want).abs().max().item() > 2e-2:
                print(f"  {config}: wrong result at context {context} batch {batch}")
                return None
            times.append(graph_ms([lambda d=d: call(d) for d in datas]))
        return times

    reference: dict[tuple[int, int], torch.Tensor] = {}
    base = run({})
    assert base is not None
    header = " | ".join(f"{c // 1024}k x{b}" for c, b, _, _ in shapes)
    print(f"| config | score | {header} |  (% of HBM per shape)")
    print("|---|---|" + "---|" * len(shapes))

    def report(name: str, times: list[float]) -> float:
        score = 1.0
        for t, b in zip(times, base):
            score *= b / t
        score **= 1 / len(times)
        pcts = " | ".join(f"{100 * kv / (t * 1e-3) / hbm:.0f}%" for t, (_, _, kv, _) in zip(times, shapes))
        print(f"| {name} | {score:.3f} | {pcts} |", flush=True)
        return score

    report("default", base)
    results: dict[tuple[int, int, int | None], float] = {}
    for tile in SWEEP_TILES:
        for warps in SWEEP_WARPS:
            times = run({"tile": tile, "warps": warps})
            if times is not None:
                results[(tile, warps, None)] = report(f"tile={tile},warps={warps}", times)
    tile, warps, _ = max(results, key=results.__getitem__)
    for stages in SWEEP_STAGES:
        times = run({"tile": tile, "warps": warps, "stages": stages})
        if times is not None:
            results[(tile, warps, stages)] = report(f"tile={tile},warps={warps},stages={stages}", times)
    tile, warps, stages = max(results, key=results.__getitem__)
    best = f"tile={tile},warps={warps}" + (f",stages={stages}" if stages else "")
    print(f"\nBEST {best} (score {results[(tile, warps, stages)]:.3f} vs the current default)")
    if results[(tile, warps, stages)] < WORTH_A_CHANGE:
        best = ""  # keep the default
    if best_out:
        with open(best_out, "w") as f:
            f.write(best + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256])
    parser.add_argument("--tile-size", type=int, default=None, help="keys per inner step (default: kernel's)")
    parser.add_argument(
        "--splits", type=int, default=None, help="KV splits (default: the kernel's heuristic)"
    )
    parser.add_argument("--sweep", action="store_true", help="search the decode launch shape instead")
    parser.add_argument("--best-out", default=None, help="with --sweep: write the winner here")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit(
            "bench/kernel_attention.py needs a CUDA GPU (none found); the kernels' CPU tests are "
            "tests/kernels (TRITON_INTERPRET=1)."
        )
    try:
        from triton.testing import do_bench
    except ImportError:
        sys.exit("triton is not installed: pip install 'tandem[triton]'")
    from kernels.paged_attention import _auto_num_splits, decode_launch_config, unified_paged_attention

    hbm = measure_hbm_bandwidth(do_bench)
    print(
        f"device: {torch.cuda.get_device_name()}; measured HBM bandwidth (D2D copy): {hbm / 1e9:.0f} GB/s\n"
    )
    if args.sweep:
        sweep(hbm, args.best_out)
        return
    print(
        "| context | batch | splits | triton us | triton GB/s | % HBM | SDPA us | SDPA GB/s | % HBM "
        "| triton eager us (% HBM) | SDPA eager us (% HBM) | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    scale = HEAD_DIM**-0.5
    for context in args.contexts:
        for batch in args.batches:
            bytes_per_copy = 2 * 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize  # paged + contiguous K, V
            copies = max(1, min(64, -(-L2_FLUSH_BYTES // bytes_per_copy)))
            triton_calls, sdpa_calls, diff = [], [], 0.0
            for _ in range(copies):
                data = make_decode_batch(batch, context)
                k, v = contiguous_kv(data)
                q4 = data["query"].view(batch, KV_HEADS * GROUP, 1, HEAD_DIM)

                def triton_fn(data=data, context=context):
                    return unified_paged_attention(
                        data["query"], data["cache"], data["qsl"], data["seq_lens"], data["table"], scale, 1,
                        context, num_kv_splits=args.splits, tile_size=args.tile_size,
                    )

                def sdpa_fn(q4=q4, k=k, v=v):
                    return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

                if not triton_calls:
                    got, want = triton_fn().float(), sdpa_fn().view(batch, -1, HEAD_DIM).float()
                    diff = (got - want).abs().max().item()
                triton_calls.append(triton_fn)
                sdpa_calls.append(sdpa_fn)
            del data, k, v, q4
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
            num_bytes = kv_bytes + batch * KV_HEADS * GROUP * HEAD_DIM * DTYPE.itemsize  # K + V + q
            t_ms, s_ms = graph_ms(triton_calls), graph_ms(sdpa_calls)
            te_ms = do_bench(triton_calls[0], warmup=25, rep=200)
            se_ms = do_bench(sdpa_calls[0], warmup=25, rep=200)
            tile = args.tile_size or decode_launch_config(HEAD_DIM).get("tile", BLOCK_SIZE)
            splits = args.splits or _auto_num_splits(torch.device("cuda"), batch, KV_HEADS, context, tile)

            def pct(ms: float, num_bytes: int = num_bytes) -> float:
                return 100 * num_bytes / (ms * 1e-3) / hbm

            t_bw, s_bw = num_bytes / (t_ms * 1e-3), num_bytes / (s_ms * 1e-3)
            print(
                f"| {context} | {batch} | {splits} | {t_ms * 1e3:.1f} | {t_bw / 1e9:.0f} | {pct(t_ms):.0f}% "
                f"| {s_ms * 1e3:.1f} | {s_bw / 1e9:.0f} | {pct(s_ms):.0f}% "
                f"| {te_ms * 1e3:.1f} ({pct(te_ms):.0f}%) | {se_ms * 1e3:.1f} ({pct(se_ms):.0f}%) | {diff:.2e} |",
                flush=True,
            )
            del triton_calls, sdpa_calls
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
