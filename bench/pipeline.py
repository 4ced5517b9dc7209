"""Pipeline parallelism on CPU: offline throughput of 1 process vs TP=2 vs PP=2, and how busy each
pipeline stage is with the batch queue one batch deep vs P deep.

Each configuration runs the same workload (greedy, ignore_eos, random prompts) on one engine core,
configurations alternating round by round; reported: output tokens/s per round, the median and the
spread (min-max), and for multi-process runs each rank's idle fraction over the timed run (1 - the time
it spent computing a step / the run's wall time; waiting for the previous stage's activations counts
as idle). "pp2-depth1" is PP=2 with the queue forced to one batch: the stages then take turns.
"tp2-ray" / "pp2-ray" run the same ranks as Ray actors (--distributed-executor-backend ray) on a local
Ray cluster started once, before the first round; "ms/step" is the timed run's wall time per engine step.

    python bench/pipeline.py [--rounds 3] [--num-requests 16] [--layers 6] [--hidden 256]
    python bench/pipeline.py --configs tp2 tp2-ray pp2 pp2-ray   # the Ray executor vs the mp one
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_svc.worker.worker import Worker

TIMING_ENV = "TANDEM_BENCH_STAGE_TIMING"
CONFIGS: dict[str, dict[str, Any]] = {
    "1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "pp2-depth1": {"pipeline_parallel_size": 2},
    "tp2-ray": {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
    "pp2-ray": {"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"},
}
DEFAULT_CONFIGS = ["1", "tp2", "pp2", "pp2-depth1"]


class TimedWorker(Worker):
    """A real Worker that keeps its busy time (step time minus waiting for activations) in a file."""

    busy = recv = 0.0
    steps = 0

    def load_model(self) -> None:
        super().load_model()
        assert self.runner is not None
        stage, inner = self.runner.stage, self.runner.stage.recv

        def timed_recv(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args)
            finally:
                self.recv += time.perf_counter() - t

        stage.recv = timed_recv  # type: ignore[method-assign]

    def execute_model(self, so: Any) -> Any:
        t, recv = time.perf_counter(), self.recv
        out = super().execute_model(so)
        self.busy += time.perf_counter() - t - (self.recv - recv)
        self.steps += 1
        path = Path(os.environ[TIMING_ENV], f"rank{self.rank}.json")
        path.with_suffix(".tmp").write_text(json.dumps({"busy": self.busy}))
        path.with_suffix(".tmp").replace(path)  # atomic: the engine may read it while a rank writes
        return out


def read_busy(folder: Path) -> dict[int, float]:
    return {int(p.stem[4:]): json.loads(p.read_text())["busy"] for p in sorted(folder.glob("rank*.json"))}


def run(model_dir: Path, name: str, work: list[tuple[list[int], int]], timing: Path) -> dict[str, Any]:
    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore
    from engine_svc.executor.multiproc import MultiprocExecutor
    from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

    config = EngineConfig.create(model=str(model_dir), device="cpu", dtype="float32", **CONFIGS[name])
    multi = config.tensor_parallel_size * config.pipeline_parallel_size > 1
    executor: Any = None
    if config.executor_backend == "ray":
        from engine_svc.executor.ray_executor import RayExecutor

        executor = RayExecutor(config, worker_cls="bench.pipeline:TimedWorker")
    elif multi:
        executor = MultiprocExecutor(config, worker_cls="bench.pipeline:TimedWorker")
    core = EngineCore(config, executor=executor)
    if name.endswith("depth1"):
        core.max_concurrent_batches = 1

    def drive(requests: list[tuple[list[int], int]], tag: str) -> int:
        for i, (prompt, out) in enumerate(requests):
            core.add_request(EngineCoreRequest(
                request_id=f"{tag}{i}", prompt_token_ids=prompt,
                sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)))
        tokens = 0
        while core.has_unfinished_requests():
            tokens += sum(len(o.new_token_ids) for o in core.step().outputs)
            steps[0] += 1
        return tokens

    steps = [0]

    try:
        drive(work[:2], "warm")
        before = read_busy(timing) if multi else {}
        t0, steps[0] = time.perf_counter(), 0
        tokens = drive(work, "r")
        wall = time.perf_counter() - t0
        after = read_busy(timing) if multi else {}
    finally:
        core.shutdown()
    assert tokens == sum(out for _, out in work)
    idle = {rank: 1 - (after[rank] - before.get(rank, 0.0)) / wall for rank in after}
    return {"tok_s": tokens / wall, "ms_step": 1000 * wall / steps[0], "idle": idle}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    args = ap.parse_args()
    if any(name.endswith("-ray") for name in args.configs):
        import ray

        ray.init(address="local", num_cpus=4, include_dashboard=False)  # once: start-up is not timed
    from entrypoints.tiny_model import make_tiny_model

    rng = random.Random(0)
    work = [([rng.randrange(10, 500) for _ in range(rng.randint(32, 96))], rng.randint(32, 64))
            for _ in range(args.num_requests)]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in args.configs}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", num_layers=args.layers, hidden_size=args.hidden,
                                    num_heads=4, num_kv_heads=2, vocab_size=512)
        for r in range(args.rounds):
            for name in args.configs:
                timing = Path(tmp) / f"timing-{name}-{r}"
                timing.mkdir()
                os.environ[TIMING_ENV] = str(timing)
                res = run(model_dir, name, work, timing)
                results[name].append(res)
                idle = " ".join(f"rank{k}={v:.0%}" for k, v in sorted(res["idle"].items()))
                print(f"round {r} {name:>10}: {res['tok_s']:7.1f} tok/s {res['ms_step']:6.1f} ms/step  idle {idle}",
                      flush=True)
    base = statistics.median(x["tok_s"] for x in results[args.configs[0]])
    print(f"\n{'config':>10} {'tok/s median':>13} {'(min-max)':>15} {'vs ' + args.configs[0]:>8} "
          f"{'ms/step median':>15} {'(min-max)':>13}  idle (median per rank)")
    for name, runs in results.items():
        speeds, step_ms = [x["tok_s"] for x in runs], [x["ms_step"] for x in runs]
        med = statistics.median(speeds)
        ranks = sorted(runs[0]["idle"])
        idle = " ".join(f"rank{k}={statistics.median(x['idle'][k] for x in runs):.0%}" for k in ranks)
        print(f"{name:>10} {med:13.1f} {f'({min(speeds):.1f}-{max(speeds):.1f})':>15} {med / base:8.2f} "
              f"{statistics.median(step_ms):15.1f} {f'({min(step_ms):.1f}-{max(step_ms):.1f})':>13}  {idle}")


if __name__ == "__main__":
    main()
