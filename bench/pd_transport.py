"""The P/D side channel alone: a pull's bytes between two processes, without the engines around it.

A producer process holds a synthetic K/V cache shaped like SmolLM2-135M's (30 layers, 3 KV heads of 64,
16-token blocks, float32: 720 KiB per block) and offers pulls over a `SideChannelServer`, reading the
blocks span by span (engine_svc/kv_transfer/source.py) in one of two ways, `--producer`:
`staging` (round 5, and what a cache on a device still does: gather each span into a staging buffer,
CRC-32, send) or `views` (round 6: CRC-32 over views of the cache's own memory, `sendmsg` of the same
views, no copy). This process receives each pull into a fresh buffer while summing it
(side_channel.receive + checksum.SpanSums), checks the sums, then times two copies of the same bytes
(`bytearray()`, and a copy into a fresh numpy array, which gets huge pages). The producer modes alternate
pull by pull; reports medians and spreads over `--rounds` pulls per size and mode.

    python bench/pd_transport.py --blocks 32 64 128 --rounds 9 --producer staging views
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, CACHE_BLOCKS = 30, 3, 64, 16, 600
BLOCK_BYTES = LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4


def producer(conn: Connection) -> None:
    import torch

    from engine_svc.kv_transfer.blocks import cache_views, read_blocks
    from engine_svc.kv_transfer.side_channel import SideChannelServer
    from engine_svc.kv_transfer.source import PullSource

    caches = [torch.randn(2, CACHE_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    server = SideChannelServer("127.0.0.1", 0)
    conn.send(server.port)
    views = cache_views(caches)
    assert views is not None
    while (order := conn.recv()) is not None:
        block_ids, mode = order
        source = PullSource(lambda ids, out: read_blocks(caches, ids, out), block_ids, BLOCK_BYTES,
                            views=views if mode == "views" else None)
        ticket, transfer = server.offer(source if mode == "staging" else source.pieces())
        conn.send((ticket, source.span_bytes))
        transfer.done.wait()
        conn.send((source.crcs, transfer.error))
    server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 128], help="blocks per pull (720 KiB each)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--producer", nargs="+", choices=["staging", "views"], default=["staging", "views"],
                   help="how the producer reads the blocks (alternated pull by pull)")
    args = p.parse_args()
    import numpy

    from engine_svc.kv_transfer.checksum import SpanSums, first_mismatch
    from engine_svc.kv_transfer.side_channel import receive

    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.Process(target=producer, args=(theirs,), daemon=True)
    child.start()
    port = ours.recv()
    for num_blocks in args.blocks:
        size = num_blocks * BLOCK_BYTES
        runs: dict[str, tuple[list[float], list[float], list[float]]] = {m: ([], [], []) for m in args.producer}
        for r, mode in ((r, m) for r in range(args.rounds) for m in args.producer):
            pulls, ratios, ratios_np = runs[mode]
            first = (r * 7) % (CACHE_BLOCKS - num_blocks)
            ours.send((list(range(first, first + num_blocks)), mode))
            ticket, span_bytes = ours.recv()
            start = time.perf_counter()
            buffer = numpy.empty(size, dtype=numpy.uint8).data
            with SpanSums(buffer, span_bytes) as sums:
                receive("127.0.0.1", port, ticket, buffer, 60, sums)
            pull = time.perf_counter() - start
            crcs, error = ours.recv()
            assert error is None and first_mismatch(sums.crcs, crcs, span_bytes, size) is None, error
            start = time.perf_counter()
            bytearray(buffer)
            copy = time.perf_counter() - start
            start = time.perf_counter()
            numpy.copyto(numpy.empty(size, dtype=numpy.uint8), numpy.frombuffer(buffer, dtype=numpy.uint8))
            copy_np = time.perf_counter() - start
            pulls.append(pull)
            ratios.append(copy / pull)
            ratios_np.append(copy_np / pull)
        for mode, (pulls, ratios, ratios_np) in runs.items():
            pull = statistics.median(pulls)
            print(f"{num_blocks:4d} blocks, {size / 2**20:6.1f} MiB, {mode:7s}: pull {size / pull / 2**20:6.0f} MiB/s "
                  f"({pull * 1000:.1f} ms, spread {min(pulls) * 1000:.1f}-{max(pulls) * 1000:.1f}); pull/bytearray "
                  f"{statistics.median(ratios):.1%} ({min(ratios):.1%}-{max(ratios):.1%}), pull/numpy copy "
                  f"{statistics.median(ratios_np):.1%} ({min(ratios_np):.1%}-{max(ratios_np):.1%})", flush=True)
    ours.send(None)
    child.join(10)


if __name__ == "__main__":
    main()
