"""Serving benchmark: the offline workload sent through `tandem-frontend` -> `tandem-engine` processes
with N concurrent streams (vLLM `bench serve --max-concurrency N` style), side by side in one run with
the in-process offline API (`engine_svc.LLM`) on the same workload.

Workload (as bench/offline.py): 64 requests, prompt and output lengths uniform in [16, 256], random
prompt token ids, ignore_eos, greedy, a tiny random-weight Llama (6 layers x hidden 256).

Reports output tok/s, TTFT, TPOT and ITL (p50/p99), the served/offline throughput ratio, and the
split's added per-token latency (served ITL p50 minus the in-process step time). `--tracing` runs the
served part with tracing off and on (OTEL_TRACES_SAMPLER=always_on, OTLP/gRPC to a receiver this
script starts), alternating off/on for `--rounds` rounds so that run order does not bias the result,
and prints the throughput cost from the per-mode medians. On a small CPU box the engine, the frontend and this
client share the cores: read the numbers as a ratio measured in one run.

    python bench/serve.py [--num-requests 64] [--concurrency 64] [--tracing [--rounds 3]]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from offline import add_workload_args, build_model_and_workload, run_tandem  # noqa: E402
from tandem.v1 import generation_pb2 as pb  # noqa: E402
from tandem.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(port: int, proc: subprocess.Popen[bytes], timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"a service exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"port {port} not SERVING after {timeout}s")


class Split:
    """An engine and a frontend process on free loopback ports (stopped with SIGTERM on exit)."""

    def __init__(self, model_dir: Path, concurrency: int, env: dict[str, str], log_dir: Path) -> None:
        self.port = free_port()
        engine_port = free_port()
        common = {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **common, **env}
        self.procs = [
            self._start(["engine_svc.server_cli", "--model", str(model_dir), "--host", "127.0.0.1",
                         "--port", str(engine_port), "--dtype", "float32", "--metrics-port", "0",
                         "--log-level", "WARNING"], full_env, log_dir / "engine.log"),
            self._start(["frontend_svc.cli", "--model", str(model_dir), "--engine", f"127.0.0.1:{engine_port}",
                         "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", "0",
                         "--max-concurrent-requests", str(max(concurrency, 1) * 2), "--log-level", "WARNING"],
                        full_env, log_dir / "frontend.log"),
        ]
        wait_serving(engine_port, self.procs[0])
        wait_serving(self.port, self.procs[1])

    @staticmethod
    def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


async def _one(stub: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    request = pb.GenerateRequest(sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   ignore_eos=True))
    request.token_ids.ids.extend(prompt)
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    async for response in stub.Generate(request):
        if response.token_ids:
            arrivals.append((time.perf_counter(), len(response.token_ids)))
    tokens = sum(n for _, n in arrivals)
    ttft = arrivals[0][0] - start
    e2e = arrivals[-1][0] - start
    itl = [b[0] - a[0] for a, b in itertools.pairwise(arrivals)]
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0
    return {"tokens": tokens, "ttft": ttft, "e2e": e2e, "itl": itl, "tpot": tpot}


async def _drive(port: int, work: list[tuple[list[int], int]], concurrency: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await _one(stub, work[0][0], 4)  # warm-up
        pending = list(reversed(work))
        results: list[dict[str, Any]] = []

        async def worker() -> None:
            while pending:
                prompt, out = pending.pop()
                results.append(await _one(stub, prompt, out))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(work)))))
        elapsed = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    assert tokens == sum(out for _, out in work), "the split produced a different number of tokens"
    itl = [x for r in results for x in r["itl"]]
    return {"elapsed": elapsed, "tokens": tokens, "tok_s": tokens / elapsed,
            "ttft": [r["ttft"] for r in results], "tpot": [r["tpot"] for r in results], "itl": itl}


def run_served(model_dir: Path, work: list[tuple[list[int], int]], concurrency: int,
               env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as logs:
        split = Split(model_dir, concurrency, env, Path(logs))
        try:
            return asyncio.run(_drive(split.port, work, concurrency))
        finally:
            split.stop()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def row(name: str, r: dict[str, Any]) -> str:
    ms = 1e3
    return (f"| {name} | {r['tok_s']:.0f} | {r['elapsed']:.2f} | {ms * statistics.median(r['ttft']):.1f} | "
            f"{ms * pct(r['ttft'], 99):.1f} | {ms * statistics.median(r['tpot']):.2f} | "
            f"{ms * pct(r['itl'], 50):.2f} | {ms * pct(r['itl'], 99):.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64, help="concurrent client streams")
    ap.add_argument("--tracing", action="store_true", help="also run the split with tracing on")
    ap.add_argument("--rounds", type=int, default=3, help="with --tracing: off/on pairs to alternate")
    ap.add_argument("--skip-offline", action="store_true")
    add_workload_args(ap)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, work = build_model_and_workload(tmp, args)
        print(f"workload: {len(work)} requests, prompt+output lengths U[{args.min_len},{args.max_len}], "
              f"model {args.num_layers}L x {args.hidden_size}, {os.cpu_count()} CPUs, "
              f"concurrency {args.concurrency}")
        offline = None if args.skip_offline else run_tandem(model_dir, work, 1)
        runs: dict[str, list[dict]] = {"split, tracing off": [], "split, tracing on": []}
        spans = 0
        if args.tracing:
            from tests.observability.otlp_receiver import OtlpReceiver

            with OtlpReceiver() as receiver:
                env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
                       "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "always_on"}
                for _ in range(args.rounds):  # alternate, so neither mode always runs first
                    runs["split, tracing off"].append(run_served(model_dir, work, args.concurrency, {}))
                    runs["split, tracing on"].append(run_served(model_dir, work, args.concurrency, env))
                spans = len(receiver.spans())
        else:
            runs["split, tracing off"].append(run_served(model_dir, work, args.concurrency, {}))
        served = {name: sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2] for name, rs in runs.items() if rs}

    print("\n| system | output tok/s | elapsed s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms | "
          "ITL p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    if offline is not None:
        print(f"| offline LLM (in-process) | {offline['tok_s']:.0f} | {offline['elapsed']:.2f} | - | - | - | "
              f"{offline.get('step_ms', float('nan')):.2f} (step) | - |")
    for name, r in served.items():
        print(row(name, r))
    base = served["split, tracing off"]
    if offline is not None:
        print(f"\nserved / offline throughput = {base['tok_s'] / offline['tok_s']:.2f}")
        if "step_ms" in offline:
            added = 1e3 * pct(base["itl"], 50) - offline["step_ms"]
            print(f"added per-token latency (ITL p50 through the split - in-process step time) = {added:.2f} ms")
    if "split, tracing on" in served:
        on = served["split, tracing on"]
        pairs = ", ".join(f"{100 * (1 - b['tok_s'] / a['tok_s']):+.1f}%"
                          for a, b in zip(runs["split, tracing off"], runs["split, tracing on"]))
        print(f"tracing overhead (throughput, medians of {args.rounds} alternating rounds) = "
              f"{100 * (1 - on['tok_s'] / base['tok_s']):.1f}% (per round: {pairs}; {spans} spans received)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
