"""Sliding-window models on CPU: KV capacity with blocks freed behind the window, and decode steps of a
model with attention sinks on the native op. Writes its own tiny random models into --workdir.

`capacity`: a tiny Mistral whose layers slide over --window tokens; --requests requests of --prompt
prompt tokens each decode --decode tokens, through a KV cache of --blocks blocks of 16 tokens, once with
blocks freed behind the window and once with every block kept (--disable-hybrid-kv-cache-manager).
Printed per mode: the most requests running at once, the median running while all were admitted,
preemptions, steps and wall time (the machine may be shared: the wall time is indicative only).

    python bench/sliding_window.py capacity --window 1024 --prompt 8000 --decode 192 --requests 16 --blocks 1024

`hybrid-capacity`: the same with a tiny gpt-oss (a sliding layer over --window tokens and a full layer),
in the same KV memory (--blocks blocks of 16 tokens of both layers) once with its KV groups (one block
table per attention type: the sliding layer's blocks freed behind the window, the full layer's kept;
the pool has twice as many blocks of one layer each) and once with every block of both layers kept
(--disable-hybrid-kv-cache-manager).

    python bench/sliding_window.py hybrid-capacity --window 1024 --prompt 8000 --decode 192 --requests 16 --blocks 1024

`unequal-capacity`: the same with a tiny Qwen3 of --full full-attention and --sliding sliding layers
(`layer_types`; hidden 64, 2 KV heads of 16), whose KV groups have the counts' greatest common divisor of
layers each (2 full + 10 sliding: one full group and five sliding ones of two layers), in the same KV
memory (--blocks blocks of 16 tokens of every layer) once with the groups and once with one table keeping
every block. Also printed: the most KV memory in use at once and per request at its longest.

    python bench/sliding_window.py unequal-capacity --full 2 --sliding 10 --window 256 --prompt 2000 --decode 64 --requests 12 --blocks 512

`dense-step`: the one-table path's cost: a tiny Llama (4 layers, hidden 256), 32 decodes after 256-token
prompts; the median wall and CPU (process) time of --steps decode steps. Run it alternately on two trees
(PYTHONPATH) to compare them.

    python bench/sliding_window.py dense-step --steps 60

`sinks-decode`: a tiny gpt-oss (sliding and full layers in turn, attention sinks on every layer);
--decoders requests decode with --context-token prompts; decode steps are timed in rounds that alternate
the native CPU decode op (sinks and windows in the op) and the torch path the sink layers took before
(`TorchAttentionBackend(native=False)`: per-request gathers and matmuls). Printed: median and min-max of
the decode step per path.

    python bench/sliding_window.py sinks-decode --decoders 32 --context 512 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.kv.hybrid_manager import HybridKVCacheManager
from engine_svc.kv.kv_cache_manager import NULL_BLOCK, KVCacheManager
from entrypoints.tiny_model import make_tiny_model
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams


def _model(workdir: Path, arch: str, max_position: int, **shape: int) -> Path:
    out = workdir / (f"{arch}-{max_position}-" + "-".join(f"{k}{v}" for k, v in sorted(shape.items())))
    if not (out / "config.json").exists():
        make_tiny_model(out, arch=arch, max_position_embeddings=max_position, vocab_size=512, **shape)
    return out


def capacity(args: argparse.Namespace) -> None:
    hybrid = args.cmd != "capacity"
    if args.cmd == "unequal-capacity":
        num_layers = args.full + args.sliding
        src = _model(args.workdir, "qwen3", 16384, num_layers=num_layers, hidden_size=64, num_heads=4,
                     num_kv_heads=2, head_dim=16)
        # full layers spread evenly among the sliding ones (as gpt-oss and Gemma-style configs place them)
        every = num_layers // args.full
        types = ["full_attention" if i % every == every - 1 and i // every < args.full else "sliding_attention"
                 for i in range(num_layers)]
        extra: dict[str, object] = {"use_sliding_window": True, "layer_types": types}
        name = f"Qwen3 ({args.full} full + {args.sliding} sliding layers)"
    elif hybrid:
        num_layers, extra, name = 2, {}, "gpt-oss (sliding, full)"
        src = _model(args.workdir, "gpt_oss", 16384, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, intermediate_size=32, num_experts=8)
    else:
        num_layers, extra, name = 2, {}, "Mistral"
        src = _model(args.workdir, "mistral", 16384, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    config_path = src / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "sliding_window": args.window, **extra}))
    layer_block = 2 * 2 * 16 * 4 * 16  # K and V, 2 KV heads of 16, float32, 16 tokens: one layer's block
    block_bytes = num_layers * layer_block
    print(f"tiny {name}, window {args.window}; {args.requests} "
          f"requests of {args.prompt} + {args.decode} tokens; KV cache of {args.blocks} blocks x 16 tokens of "
          f"every layer ({args.blocks * block_bytes / 2**20:.0f} MiB)")
    print("| KV blocks | pool blocks | most running | median running | preemptions | steps | peak KV MiB in use "
          "| KV MiB per request at its longest | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for keep in (False, True):
        engine = EngineConfig.create(model=str(src), dtype="float32", device="cpu", block_size=16,
                                     kv_cache_memory_bytes=args.blocks * block_bytes,
                                     disable_hybrid_kv_cache_manager=keep)
        core = EngineCore(engine)
        groups = core.scheduler.kv.num_groups
        pool_block = block_bytes // groups  # bytes of one pool block: one group's layers
        rng = random.Random(0)
        params = EngineSamplingParams(temperature=0.0, max_tokens=args.decode, ignore_eos=True)
        for i in range(args.requests):
            prompt = [rng.randrange(5, 500) for _ in range(args.prompt)]
            core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params))
        running: list[int] = []
        in_use, per_request = 0, 0
        start = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
            running.append(len(core.scheduler.running))
            in_use = max(in_use, core.num_blocks - core.scheduler.kv.num_free_blocks)
            for r in core.scheduler.running:
                per_request = max(per_request, _held(core.scheduler.kv, r.request_id))
        wall = time.perf_counter() - start
        admitted = [n for n, w in zip(running, _waiting_trace(running)) if w]
        kept = "all kept" if keep else ("KV groups, sliding groups freed" if hybrid else "freed behind the window")
        print(f"| {kept} | {core.num_blocks} | {max(running)} | "
              f"{statistics.median(admitted or running):.0f} | {core.scheduler.num_preemptions} | {len(running)} | "
              f"{in_use * pool_block / 2**20:.1f} | {per_request * pool_block / 2**20:.2f} | {wall:.1f} |", flush=True)
        core.shutdown()


def _held(kv: KVCacheManager | HybridKVCacheManager, request_id: str) -> int:
    """Pool blocks the request holds (in every group): its table entries but those freed behind a window."""
    managers = kv.groups if isinstance(kv, HybridKVCacheManager) else [kv]
    return sum(b is not NULL_BLOCK for m in managers for b in m._tables.get(request_id, ()))


def _waiting_trace(running: list[int]) -> list[bool]:
    """True for the steps up to the last one with the most requests running (the loaded phase)."""
    last = max(i for i, n in enumerate(running) if n == max(running))
    return [i <= last for i in range(len(running))]


def sinks_decode(args: argparse.Namespace) -> None:
    src = _model(args.workdir, "gpt_oss", 4096, num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2,
                 head_dim=64, intermediate_size=128, num_experts=8)
    config = EngineConfig.create(model=str(src), dtype=args.dtype, device="cpu", max_model_len=4096)
    core = EngineCore(config)
    backend = core.executor.worker.model.attn_backend  # type: ignore[attr-defined]
    rng = random.Random(0)
    params = EngineSamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
    for i in range(args.decoders):
        prompt = [rng.randrange(5, 500) for _ in range(args.context)]
        core.add_request(EngineCoreRequest(request_id=f"d{i}", prompt_token_ids=prompt, sampling_params=params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or len(core.scheduler.waiting):
        core.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for native in (True, False):
            backend._native = native
            core.step()  # one untimed step per switch
            for _ in range(args.steps):
                t0 = time.perf_counter()
                core.step()
                times[native].append(time.perf_counter() - t0)
    print(f"tiny gpt-oss ({args.dtype}, 4 layers, hidden 256, 8 heads / 2 KV heads of 64, window 8 on layers 0 "
          f"and 2), {args.decoders} decodes with {args.context}-token prompts, {args.rounds} alternating rounds "
          f"of {args.steps} steps")
    print("| decode attention | step ms median | min - max |")
    print("|---|---|---|")
    for native in (False, True):
        t = sorted(times[native])
        label = "native op (sinks, windows)" if native else "torch per-request path"
        print(f"| {label} | {statistics.median(t) * 1e3:.2f} | {t[0] * 1e3:.2f} - {t[-1] * 1e3:.2f} |")
    core.shutdown()


def dense_step(args: argparse.Namespace) -> None:
    src = _model(args.workdir, "llama", 2048, num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2)
    core = EngineCore(EngineConfig.create(model=str(src), dtype="float32", device="cpu", max_model_len=2048))
    rng = random.Random(0)
    params = EngineSamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
    for i in range(32):
        prompt = [rng.randrange(5, 500) for _ in range(256)]
        core.add_request(EngineCoreRequest(request_id=f"d{i}", prompt_token_ids=prompt, sampling_params=params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or len(core.scheduler.waiting):
        core.step()
    for _ in range(5):
        core.step()
    wall, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        core.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    print(f"dense decode step: wall median {statistics.median(wall) * 1e3:.2f} ms (min {min(wall) * 1e3:.2f}), "
          f"CPU median {statistics.median(cpu) * 1e3:.2f} ms (min {min(cpu) * 1e3:.2f})")
    core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-sliding-window"))
    sub = ap.add_subparsers(dest="cmd", required=True)
    cap = sub.add_parser("capacity")
    hyb = sub.add_parser("hybrid-capacity")
    uneq = sub.add_parser("unequal-capacity")
    uneq.add_argument("--full", type=int, default=2)
    uneq.add_argument("--sliding", type=int, default=10)
    for sizes in (cap, hyb, uneq):
        sizes.add_argument("--window", type=int, default=1024)
        sizes.add_argument("--prompt", type=int, default=8000)
        sizes.add_argument("--decode", type=int, default=192)
        sizes.add_argument("--requests", type=int, default=16)
        sizes.add_argument("--blocks", type=int, default=1024)
    dense = sub.add_parser("dense-step")
    dense.add_argument("--steps", type=int, default=60)
    dec = sub.add_parser("sinks-decode")
    dec.add_argument("--decoders", type=int, default=32)
    dec.add_argument("--context", type=int, default=512)
    dec.add_argument("--rounds", type=int, default=6)
    dec.add_argument("--steps", type=int, default=10)
    dec.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    {"capacity": capacity, "hybrid-capacity": capacity, "unequal-capacity": capacity, "dense-step": dense_step,
     "sinks-decode": sinks_decode}[args.cmd](args)


if __name__ == "__main__":
    main()
