"""A MoE model's CPU decode against the dense model with the same active parameters, in process.

`layer`: one layer's experts alone, each CPU path (the native op, torch ops on the stacked weights, torch
ops on oneDNN-packed weights) against the dense MLP with the same active parameters, at each batch size,
the paths taking turns round by round (the machine is shared). `step` (the default): whole decode steps.

The MoE model is Qwen3-MoE-shaped with random weights (hidden 1024, 16 layers, 16 heads of 64, 4 KV heads,
64 experts of 256, top-8); the dense twin is Qwen3 with one MLP of 8 x 256 = 2048 (the same active
parameters per token: what a step must multiply). Both are built once under .tiny-models/ (a few minutes,
~3.3 GB for the MoE model in float32). For each batch size, B requests with 64-token prompts are
prefilled, then decode steps are timed, MoE and dense alternating round by round on the same machine.
Printed per batch: the decode step (median, spread over rounds), tokens/s, the MoE layer blocks' share of
a MoE step (router, routing and experts, timed around each block), and MoE step / dense step.

    python bench/moe.py --dtype bfloat16 --batch 1 32
    python bench/moe.py --dtype float32 --batch 1 32 --rounds 5
    python bench/moe.py layer --dtype bfloat16 float32 --batch 1 8 32
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

ROOT = Path(__file__).resolve().parents[1] / ".tiny-models"
SHAPE = dict(hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4, head_dim=64, vocab_size=4096,
             max_position_embeddings=4096)
EXPERTS, TOP_K, EXPERT_SIZE = 64, 8, 256
PROMPT = 64


def build_models() -> tuple[Path, Path]:
    """(MoE model dir, dense model dir), made once."""
    from entrypoints.tiny_model import make_tiny_model

    moe, dense = ROOT / "bench-qwen3-moe-64x256-top8", ROOT / "bench-qwen3-dense-2048"
    if not (moe / "config.json").exists():
        make_tiny_model(moe, arch="qwen3_moe", intermediate_size=EXPERT_SIZE, num_experts=EXPERTS,
                        num_experts_per_tok=TOP_K, **SHAPE)
    if not (dense / "config.json").exists():
        make_tiny_model(dense, arch="qwen3", intermediate_size=EXPERT_SIZE * TOP_K, **SHAPE)
    return moe, dense


class BlockTimer:
    """Wall time spent inside the model's MoE blocks (forward hooks around each block)."""

    def __init__(self, model: Any) -> None:
        from engine_svc.model.layers.moe import SparseMoeBlock

        self.total = 0.0
        self._start = 0.0
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._leave)

    def _enter(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_: Any) -> None:
        self.total += time.perf_counter() - self._start


def make_core(model: Path, dtype: str, batch: int) -> EngineCore:
    config = EngineConfig.create(model=str(model), dtype=dtype, device="cpu", max_model_len=1024,
                                 max_num_seqs=max(batch, 1), max_num_batched_tokens=max(256, batch * PROMPT),
                                 long_prefill_token_threshold=0)
    return EngineCore(config)


def start_decoding(core: EngineCore, batch: int, tag: str) -> None:
    """Add `batch` requests and step until every one has its first token (prefill done)."""
    rng = random.Random(0)
    params = EngineSamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(5, core.vocab_size) for _ in range(PROMPT)]
        core.add_request(EngineCoreRequest(request_id=f"{tag}{i}", prompt_token_ids=prompt, sampling_params=params))
    started: set[str] = set()
    while len(started) < batch:
        outputs = core.step().outputs
        failed = [o for o in outputs if (o.finished or o.error) and not o.new_token_ids]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} ended before its first token: {failed[0]}")
        started |= {o.request_id for o in outputs if o.new_token_ids}


def time_steps(core: EngineCore, steps: int, timer: BlockTimer | None) -> tuple[float, float]:
    """(median decode step seconds, share of the time inside MoE blocks)."""
    times = []
    if timer is not None:
        timer.total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    share = timer.total / sum(times) if timer is not None else 0.0
    return statistics.median(times), share


def layer_paths(dtype: Any, batch: int, copies: int) -> dict[str, Any]:
    """name -> a callable running one layer's experts (or the dense MLP) on `batch` decode rows. Each call
    takes the next of `copies` layers' weights, as a model's layers do (one layer's dense weights would
    otherwise stay in the CPU's last-level cache between calls, and its experts would not)."""
    import torch

    from engine_svc.attention import cpu_paged
    from engine_svc.model.layers import moe_cpu
    from engine_svc.model.layers.cpu_gemm import pack_weight, packed_linear

    gen = torch.Generator().manual_seed(batch)
    hidden = SHAPE["hidden_size"]
    x = torch.randn(batch, hidden, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.randn(batch, EXPERTS, generator=gen).softmax(-1), TOP_K)
    stacked, packed, dense = [], [], []
    for _ in range(copies):
        w13 = (torch.randn(EXPERTS, 2 * EXPERT_SIZE, hidden, generator=gen) * 0.03).to(dtype)
        w2 = (torch.randn(EXPERTS, hidden, EXPERT_SIZE, generator=gen) * 0.06).to(dtype)
        stacked.append(moe_cpu.CpuExperts.from_stacked(w13, w2))
        packed.append(moe_cpu.CpuExperts.from_stacked(w13, w2, pack=True))
        dense.append((pack_weight((torch.randn(2 * EXPERT_SIZE * TOP_K, hidden, generator=gen) * 0.03).to(dtype)),
                      pack_weight((torch.randn(hidden, EXPERT_SIZE * TOP_K, generator=gen) * 0.03).to(dtype))))
    op = cpu_paged.for_tensor(x)
    native = moe_cpu.native()
    turn = [0]

    def next_layer() -> int:
        turn[0] = (turn[0] + 1) % copies
        return turn[0]

    def torch_stacked() -> Any:
        moe_cpu.native.cache_clear()
        os.environ[moe_cpu.NATIVE_ENV] = "0"
        try:
            return stacked[next_layer()](x, weights, ids)
        finally:
            del os.environ[moe_cpu.NATIVE_ENV]
            moe_cpu.native.cache_clear()

    def dense_mlp() -> Any:
        gate_up, down = dense[next_layer()]
        return packed_linear(op.silu_and_mul(packed_linear(x, gate_up, None)), down, None)

    paths = {
        "torch ops": torch_stacked,
        "torch ops, packed": lambda: packed[next_layer()](x, weights, ids),
        "dense MLP": dense_mlp,
    }
    if native is not None:
        paths = {"native op": lambda: stacked[next_layer()](x, weights, ids), **paths}
    return paths


def layer_main(args: argparse.Namespace) -> None:
    import torch

    print(f"one MoE layer ({EXPERTS} experts x {EXPERT_SIZE}, top-{TOP_K}, hidden {SHAPE['hidden_size']}) vs a "
          f"dense MLP of {EXPERT_SIZE * TOP_K}, {args.layers} layers' weights in turn; median of {args.rounds} "
          f"rounds x {args.steps} calls, paths in turn")
    print("| dtype | batch | " + " | ".join(["native op", "torch ops", "torch ops, packed", "dense MLP"]) +
          " | native / dense |")
    print("|---|---|---|---|---|---|---|")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for batch in args.batch:
            paths = layer_paths(dtype, batch, args.layers)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        fn()
                    times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = [f"{med[n]:.2f} ms" if n in med else "-" for n in
                     ("native op", "torch ops", "torch ops, packed", "dense MLP")]
            ratio = f"{med['native op'] / med['dense MLP']:.2f}x" if "native op" in med else "-"
            print(f"| {dtype_name} | {batch} | " + " | ".join(cells) + f" | {ratio} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="step", choices=("step", "layer"))
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="decode steps (layer calls) timed per round")
    ap.add_argument("--layers", type=int, default=8, help="layer: copies of the weights the calls cycle through")
    args = ap.parse_args()
    if args.mode == "layer":
        layer_main(args)
        return
    for dtype in args.dtype:
        step_main(args, dtype)


def step_main(args: argparse.Namespace, dtype: str) -> None:
    moe_dir, dense_dir = build_models()
    print(f"{dtype}: Qwen3-MoE shape (hidden 1024, 16 layers, {EXPERTS} experts x {EXPERT_SIZE}, top-{TOP_K}) "
          f"vs dense Qwen3 (MLP {EXPERT_SIZE * TOP_K}); {args.rounds} rounds x {args.steps} decode steps")
    print("| batch | MoE step ms (median, min-max) | MoE tok/s | MoE blocks' share | dense step ms | dense tok/s "
          "| MoE / dense |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        moe, dense = make_core(moe_dir, dtype, batch), make_core(dense_dir, dtype, batch)
        timer = BlockTimer(moe.executor.worker.model)  # type: ignore[attr-defined]
        start_decoding(moe, batch, "m")
        start_decoding(dense, batch, "d")
        moe_ms, dense_ms, shares = [], [], []
        for _ in range(args.rounds):  # alternate: both see the same machine load
            step, share = time_steps(moe, args.steps, timer)
            moe_ms.append(1e3 * step)
            shares.append(share)
            dense_ms.append(1e3 * time_steps(dense, args.steps, None)[0])
        m, d = statistics.median(moe_ms), statistics.median(dense_ms)
        ratios = [a / b for a, b in zip(moe_ms, dense_ms, strict=True)]
        print(f"| {batch} | {m:.1f} ({min(moe_ms):.1f}-{max(moe_ms):.1f}) | {batch / m * 1e3:.1f} "
              f"| {statistics.median(shares):.0%} | {d:.1f} ({min(dense_ms):.1f}-{max(dense_ms):.1f}) "
              f"| {batch / d * 1e3:.1f} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
        moe.shutdown()
        dense.shutdown()


if __name__ == "__main__":
    main()
