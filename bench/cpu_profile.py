"""Where a CPU step's time goes: a decode step and a prefill step of a real model, by op, in each dtype.

Builds an in-process engine (EngineCore, TP=1) on `--model`, brings `--batch` requests with `--context`-token
prompts into steady decoding, then times `--steps` decode steps and profiles one with torch.profiler;
then profiles a `--prefill-len`-token prefill step on an idle engine; `--workload N` profiles instead the
whole offline workload of bench/offline.py and bench/vs_vllm.py (N requests, prompt and output lengths
uniform in [16, 256]) through `LLM.generate`. Per step it prints the wall time,
the share inside the model forward (+ logits), the ops grouped by what they are for (GEMM, attention,
norm, rotary, activation, dtype conversions, ...) and the top ops by self CPU time.

    python bench/cpu_profile.py --model .tiny-models/SmolLM2-135M-Instruct --dtype float32 bfloat16 \
        --batch 1 16 --context 256 --prefill-len 256
    python bench/cpu_profile.py --model .tiny-models/SmolLM2-135M-Instruct --dtype bfloat16 --workload 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# op name fragment -> group (first match wins; checked in this order)
GROUPS = (
    ("attention", ("scaled_dot_product", "flash_attention", "index_select", "index_put", "index_copy", "bmm",
                   "_softmax", "masked_fill", "_efficient")),
    ("gemm", ("linear", "addmm", "aten::mm", "matmul", "mkldnn", "mkl_linear")),
    ("norm", ("rms_norm", "layer_norm", "rsqrt", "pow", "mean")),
    ("rotary", ("roll", "addcmul")),
    ("activation", ("silu", "gelu")),
    ("dtype copy", ("aten::to", "_to_copy", "aten::copy_")),
    ("sampling", ("argmax", "topk", "sort", "exponential")),
)


def group_of(name: str) -> str:
    for group, fragments in GROUPS:
        if any(f in name for f in fragments):
            return group
    return "other"


def _request(i: int, prompt_len: int, max_tokens: int, vocab: int) -> Any:
    from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

    prompt = [(31 * i + 7 * j) % (vocab - 10) + 10 for j in range(prompt_len)]
    params = EngineSamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params)


def profile_step(core: Any) -> tuple[float, list[tuple[str, float, int]]]:
    """(wall ms of one core.step() under the profiler, [(op, self CPU ms, calls)] of the ops)."""
    return profiled(core.step)


def profiled(run: Any) -> tuple[float, list[tuple[str, float, int]]]:
    """(wall ms of run() under the profiler, [(op, self CPU ms, calls)] of the ops, largest first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        run()
        wall = 1e3 * (time.perf_counter() - t)
    ops = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()]
    return wall, sorted(ops, key=lambda o: -o[1])


def report(title: str, wall_ms: float, profiled_ms: float, ops: list[tuple[str, float, int]], top: int) -> None:
    total = sum(ms for _, ms, _ in ops)
    groups: dict[str, float] = defaultdict(float)
    for name, ms, _ in ops:
        groups[group_of(name)] += ms
    print(f"\n## {title}: {wall_ms:.2f} ms per step (profiled step {profiled_ms:.2f} ms, ops {total:.2f} ms)")
    print("| group | ms | share |\n|---|---|---|")
    for group, ms in sorted(groups.items(), key=lambda g: -g[1]):
        print(f"| {group} | {ms:.2f} | {100 * ms / max(total, 1e-9):.0f}% |")
    print("| op | self ms | calls |\n|---|---|---|")
    for name, ms, calls in ops[:top]:
        print(f"| {name} | {ms:.2f} | {calls} |")


def run_workload(args: argparse.Namespace, dtype: str) -> None:
    """The whole offline workload through LLM.generate, under the profiler."""
    from bench.offline import make_workload
    from entrypoints import LLM, SamplingParams

    llm = LLM(args.model, dtype=dtype, kv_cache_memory_bytes=1 << 30)
    work = make_workload(args.workload, llm.engine.vocab_size, seed=0, lo=16, hi=256)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate([work[0][0]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    wall, ops = profiled(lambda: llm.generate([p for p, _ in work], params, use_tqdm=False))
    tokens = sum(n for _, n in work)
    report(f"{args.workload} requests, {tokens} output tokens ({1e3 * tokens / wall:.0f} tok/s under the profiler)",
           wall, wall, ops, args.top)
    llm.engine.shutdown()


def run_dtype(args: argparse.Namespace, dtype: str) -> None:
    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore

    max_batch = max(args.batch)
    config = EngineConfig.create(model=args.model, dtype=dtype, device="cpu", max_num_seqs=max(max_batch, 1),
                                 max_model_len=args.context + args.steps + 64 + max(args.prefill_len, 0),
                                 enable_prefix_caching=False)
    core = EngineCore(config)
    vocab = core.vocab_size
    print(f"\n# {Path(args.model).name}, {dtype}, torch threads {torch.get_num_threads()}")
    for batch in args.batch:
        for i in range(batch):
            core.add_request(_request(i, args.context, args.steps + 8, vocab))
        while len(core.scheduler.running) < batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
        ):
            core.step()
        core.step()  # warm-up decode
        times = []
        for _ in range(args.steps - 2):
            t = time.perf_counter()
            core.step()
            times.append(1e3 * (time.perf_counter() - t))
        wall, ops = profile_step(core)
        report(f"decode, batch {batch}, context ~{args.context}", statistics.median(times), wall, ops, args.top)
        core.abort_requests([f"r{i}" for i in range(batch)])
        core.step()
    if args.prefill_len > 0:
        core.add_request(_request(10_000, args.prefill_len, 1, vocab))
        core.step()  # warm-up: the shapes of this prefill
        core.add_request(_request(10_001, args.prefill_len, 1, vocab))
        wall, ops = profile_step(core)
        report(f"prefill of {args.prefill_len} tokens", wall, wall, ops, args.top)
    core.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--workload", type=int, default=0, help="profile this many requests of the offline workload")
    args = ap.parse_args()
    for dtype in args.dtype:
        run_workload(args, dtype) if args.workload else run_dtype(args, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
