"""Host-side time of a decode step, by phase: what the CPU spends around the model forward.

On a GPU this time is either hidden behind the device (when nothing syncs) or shows as gaps between
kernels; here it is measured directly. The model is a deliberately tiny Llama (1 layer x hidden 64,
vocab 512) so that the forward's own compute is small and the step is dominated by host work:
scheduling, state updates, input preparation, metadata and host->device staging, sampling set-up and
output building.

Workload: `--batch` requests with `--prompt-len`-token prompts decode `--steps` tokens each (greedy or
`--temperature`), all admitted at once; only decode-only steps are timed. Phases (instrumented at
boundaries that every version of the engine has, so two source trees can be compared):

  schedule   Scheduler.schedule
  prepare    InputBatch.prepare (flat inputs from the persistent batch)
  forward    model forward (on CPU: its compute; on GPU: launch/replay)
  logits     model.compute_logits
  sampler    Sampler.__call__
  runner     the rest of ModelRunner.execute_model: state updates, metadata, staging, sampling metadata,
             output building
  update     Scheduler.update_from_output (outputs, stop checks)

    python bench/gpu_host_step.py [--device cpu] [--batch 256] [--steps 64]
    python bench/gpu_host_step.py --compare /tmp/base   # the same bench on another source tree, rounds
                                                        # alternating, and the ratios side by side
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("schedule", "prepare", "forward", "logits", "sampler", "runner", "update")
HOST_PHASES = ("schedule", "prepare", "runner", "update")  # pure host work on any device


def _timed(acc: dict[str, float], name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t

    return wrapper


class _TimedSampler:
    def __init__(self, inner: Any, acc: dict[str, float]) -> None:
        self._inner, self._acc = inner, acc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _timed(self._acc, "sampler", self._inner)(*args, **kwargs)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Mean microseconds per decode-only step, by phase, in the source tree this process imports."""
    import torch

    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore
    from entrypoints.tiny_model import make_tiny_model
    from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams
    from shared_runtime.heap import settle_heap

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "m", arch="llama", seed=0, num_layers=1, hidden_size=64,
                                    num_heads=2, num_kv_heads=1, vocab_size=512)
        config = EngineConfig.create(model=str(model_dir), dtype="float32", device=args.device,
                                     max_num_seqs=args.batch, max_model_len=args.prompt_len + args.steps + 8,
                                     attention_backend=args.attention_backend,
                                     # the GPU engine's step budget on any device: every request is admitted
                                     # in a few steps, so all `--batch` of them decode together (the CPU's
                                     # default 256 tokens / 64-token chunks never get there)
                                     max_num_batched_tokens=max(8192, args.batch), long_prefill_token_threshold=0)
        core = EngineCore(config)
    worker = core.executor.worker  # type: ignore[attr-defined]
    runner, sched = worker.runner, core.scheduler
    acc = dict.fromkeys(PHASES, 0.0)
    execute_total = [0.0]
    sched.schedule = _timed(acc, "schedule", sched.schedule)
    sched.update_from_output = _timed(acc, "update", sched.update_from_output)
    runner.batch.prepare = _timed(acc, "prepare", runner.batch.prepare)
    runner.model.forward = _timed(acc, "forward", runner.model.forward)
    runner.model.compute_logits = _timed(acc, "logits", runner.model.compute_logits)
    runner.sampler = _TimedSampler(runner.sampler, acc)
    inner_execute = worker.execute_model

    def execute(so: Any) -> Any:
        t = time.perf_counter()
        out = inner_execute(so)
        if args.device == "cuda":
            torch.cuda.synchronize()
        execute_total[0] += time.perf_counter() - t
        return out

    worker.execute_model = execute

    for i in range(args.batch):
        prompt = [(7 * i + j) % 500 + 5 for j in range(args.prompt_len)]
        params = EngineSamplingParams(temperature=args.temperature, max_tokens=args.steps, ignore_eos=True)
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params))
    # What a serving engine does once it is up (shared_runtime/heap.py): without it, one full collection
    # of the ~640k objects that start-up left (torch, transformers, the tiny model's build) lands in some
    # timed step (~200 ms on the CPU box) and swamps the phase it falls in.
    settle_heap()
    samples: list[dict[str, float]] = []
    while core.has_unfinished_requests():
        before = dict(acc)
        exec_before = execute_total[0]
        t = time.perf_counter()
        so_sizes = len(sched.running)
        core.step()
        total = time.perf_counter() - t
        step = {k: acc[k] - before[k] for k in PHASES}
        decode_only = step["prepare"] > 0 and so_sizes == args.batch
        inner = execute_total[0] - exec_before
        step["runner"] = inner - step["prepare"] - step["forward"] - step["logits"] - step["sampler"]
        step["total"] = total
        if decode_only:
            samples.append(step)
    warm = samples[len(samples) // 4 :]  # skip the first steps (allocator and cache warm-up)
    result = {k: 1e6 * statistics.mean(s[k] for s in warm) for k in (*PHASES, "total")}
    result["host"] = sum(result[k] for k in HOST_PHASES)
    result["steps"] = len(warm)
    core.shutdown()
    return result


def _row(name: str, r: dict[str, float]) -> str:
    cells = " | ".join(f"{r[k]:.0f}" for k in (*PHASES, "host", "total"))
    return f"| {name} | {cells} |"


def _header() -> str:
    return ("| tree | " + " | ".join(PHASES) + " | host (schedule+prepare+runner+update) | step |\n"
            + "|---" * (len(PHASES) + 3) + "|")


def _run_tree(tree: Path, argv: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json", "--tree", str(tree), *argv],
                         env=env, capture_output=True, text=True, timeout=1200, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--compare", type=Path, default=None, help="another source tree to measure side by side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tree", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    tree = args.tree or here
    sys.path.insert(0, str(tree))

    if args.json:
        print(json.dumps(measure(args)))
        return 0
    argv = [f"--device={args.device}", f"--attention-backend={args.attention_backend}", f"--batch={args.batch}",
            f"--prompt-len={args.prompt_len}", f"--steps={args.steps}", f"--temperature={args.temperature}"]
    print(f"decode steps at batch {args.batch}, context ~{args.prompt_len + args.steps // 2}, "
          f"temperature {args.temperature}, device {args.device}; mean us per step\n")
    if args.compare is None:
        print(_header())
        print(_row(str(tree), measure(args)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    print(_header())
    for _ in range(args.rounds):  # alternate, so drift in the machine's speed hits both alike
        for name, path in (("base", args.compare), ("this", here)):
            r = _run_tree(path, argv)
            runs[name].append(r)
            print(_row(f"{name} ({path})", r), flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in (*PHASES, "host", "total")}
           for name, rs in runs.items()}
    print("\nmedians:\n" + _header())
    for name in runs:
        print(_row(name, med[name]))
    ratio = {k: med["this"][k] / med["base"][k] if med["base"][k] else float("nan") for k in med["base"]}
    print("| this / base | " + " | ".join(f"{ratio[k]:.2f}" for k in (*PHASES, "host", "total")) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
