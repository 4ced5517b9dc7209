"""Serving benchmark: the offline workload sent through `tandem-frontend` -> `tandem-engine` processes
with N concurrent streams (vLLM `bench serve --max-concurrency N` style), side by side in one run with
the in-process offline API (`engine_svc.LLM`) on the same workload.

Workload (as bench/offline.py): 64 requests, prompt and output lengths uniform in [16, 256], random
prompt token ids, ignore_eos, greedy, a tiny random-weight Llama (6 layers x hidden 256), or a real
model with `--model DIR`; `--dtype float32 bfloat16` runs both systems in each dtype.

Reports output tok/s, TTFT, TPOT and ITL (p50/p99), the served/offline throughput ratio, and the
split's added per-token latency (served ITL p50 minus the in-process step time). `--tracing` runs the
served part with tracing off and on (OTEL_TRACES_SAMPLER=always_on, OTLP/gRPC to a receiver this
script starts), alternating off/on for `--rounds` rounds so that run order does not bias the result,
and prints the throughput cost from the per-mode medians. `--async-scheduling off on` runs the served
part with the engine's `--no-async-scheduling` and `--async-scheduling`, alternating for `--rounds`
rounds (which mode goes first swaps every round), and prints the on/off ratio of the per-mode medians.
`--api grpc openai` sends the same workload
through the gRPC API and through the OpenAI-compatible HTTP API (`/v1/completions`, token-id prompts,
`stream: true` over SSE, usage in the last chunk) of one frontend, alternating the two for `--rounds`
rounds, and prints the HTTP/gRPC throughput ratio. `--smg` adds an SMG gateway (`smg launch`, the Rust
gateway of the dev extra) in front of the same engine, driven with the same HTTP requests in the same
rounds (the frontend's and SMG's HTTP runs swap order every round): SMG -> tandem engine (SMG's
`vllm.grpc.engine.VllmEngine` protocol) next to tandem's own frontend, and prints the SMG/frontend
throughput ratio and the CPU seconds each path costs the services per 1000 output tokens (engine +
frontend vs engine + smg). For HTTP, TTFT and ITL are timed on SSE chunks and token counts come from the
final usage chunk. On a small CPU box the engine, the frontend and this client share the cores: read the
numbers as a ratio measured in one run.

    python bench/serve.py [--num-requests 64] [--concurrency 64] [--tracing [--rounds 3]]
    python bench/serve.py --async-scheduling off on --rounds 5 --skip-offline
    python bench/serve.py --api grpc openai --rounds 3 --skip-offline
    python bench/serve.py --api openai --smg --rounds 3 --skip-offline
    python bench/serve.py --model .tiny-models/SmolLM2-135M-Instruct --dtype float32 bfloat16 \
        --num-requests 16 --max-len 128 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
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
import httpx2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from offline import add_workload_args, build_model_and_workload, describe_model, run_tandem  # noqa: E402
from tandem.v1 import generation_pb2 as pb  # noqa: E402
from tandem.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

START_TIMEOUT_S = 180.0
APIS = ("grpc", "openai")
SMG_RUN = "SMG gateway -> engine, OpenAI HTTP/SSE"


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


def wait_http_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the frontend exited with {proc.returncode}")
        try:
            if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"HTTP port {port} not ready after {timeout}s")


def wait_smg_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Until the gateway lists a model and a healthy worker (it registers workers in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited with {proc.returncode}")
        try:
            workers = httpx2.get(f"http://127.0.0.1:{port}/workers", timeout=1).json().get("workers", [])
            if any(w.get("is_healthy") for w in workers):
                return
        except (httpx2.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"smg on port {port} not ready after {timeout}s")


class Split:
    """An engine and a frontend process on free loopback ports (stopped with SIGTERM on exit)."""

    def __init__(self, model_dir: Path, concurrency: int, env: dict[str, str], log_dir: Path,
                 dtype: str = "float32", http: bool = False, smg: bool = False,
                 engine_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.smg_port = free_port() if smg else 0
        self.http_port = free_port() if http else 0
        engine_port = free_port()
        common = {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **common, **env}
        self.procs = [
            self._start(["engine_svc.cli", "--model", str(model_dir), "--host", "127.0.0.1",
                         "--port", str(engine_port), "--dtype", dtype, "--metrics-port", "0",
                         "--log-level", "WARNING", *engine_args], full_env, log_dir / "engine.log"),
            self._start(["frontend_svc.cli", "--model", str(model_dir), "--engine", f"127.0.0.1:{engine_port}",
                         "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", "0",
                         "--max-concurrent-requests", str(max(concurrency, 1) * 2), "--log-level", "WARNING",
                         *(["--http-port", str(self.http_port)] if http else [])],
                        full_env, log_dir / "frontend.log"),
        ]
        wait_serving(engine_port, self.procs[0])
        wait_serving(self.port, self.procs[1])
        if http:
            wait_http_ready(self.http_port, self.procs[1])
        if smg:
            gateway = [str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1", "--port",
                       str(self.smg_port), "--worker-urls", f"grpc://127.0.0.1:{engine_port}", "--model-path",
                       str(model_dir), "--policy", "cache_aware", "--prometheus-port", str(free_port()),
                       "--log-level", "warn", "--max-concurrent-requests", str(max(concurrency, 1) * 2)]
            with (log_dir / "smg.log").open("ab") as out:
                self.procs.append(subprocess.Popen(gateway, cwd=ROOT, env=full_env, stdout=out,
                                                   stderr=subprocess.STDOUT))
            wait_smg_ready(self.smg_port, self.procs[-1])

    def cpu_seconds(self) -> list[float]:
        """CPU seconds (user + system) each process has used so far: engine, frontend[, smg] (Linux /proc)."""
        ticks = os.sysconf("SC_CLK_TCK")
        fields = [Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split() for proc in self.procs]
        return [(int(f[11]) + int(f[12])) / ticks for f in fields]

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
        return await _run_workers(lambda prompt, out: _one(stub, prompt, out), work, concurrency)


async def _one_http(client: httpx2.AsyncClient, prompt: list[int] | str, max_tokens: int,
                    model: str) -> dict[str, Any]:
    """One streamed /v1/completions request; arrivals are SSE chunks with text, tokens from usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in _sse_lines(response):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    ttft = arrivals[0] - start
    e2e = arrivals[-1] - start
    itl = [b - a for a, b in itertools.pairwise(arrivals)]
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0
    return {"tokens": tokens, "ttft": ttft, "e2e": e2e, "itl": itl, "tpot": tpot}


async def _sse_lines(response: Any) -> Any:
    """The stream's lines split on b"\n" only: a text may hold U+2028 and other characters that str line
    splitting (httpx's aiter_lines) breaks on, which SMG's JSON leaves unescaped."""
    pending = b""
    async for data in response.aiter_bytes():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")


async def _drive_http(port: int, work: list[tuple[Any, int]], concurrency: int, model: str) -> dict[str, Any]:
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                  timeout=httpx2.Timeout(600.0)) as client:
        await _one_http(client, work[0][0], 4, model)  # warm-up
        return await _run_workers(lambda prompt, out: _one_http(client, prompt, out, model), work, concurrency)


async def _run_workers(one: Any, work: list[tuple[Any, int]], concurrency: int) -> dict[str, Any]:
    pending = list(reversed(work))
    results: list[dict[str, Any]] = []

    async def worker() -> None:
        while pending:
            prompt, out = pending.pop()
            results.append(await one(prompt, out))

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(work)))))
    elapsed, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(r["tokens"] for r in results)
    assert tokens == sum(out for _, out in work), "the split produced a different number of tokens"
    itl = [x for r in results for x in r["itl"]]
    return {"elapsed": elapsed, "tokens": tokens, "tok_s": tokens / elapsed, "client_cpu": client_cpu,
            "ttft": [r["ttft"] for r in results], "tpot": [r["tpot"] for r in results], "itl": itl}


def run_served(model_dir: Path, work: list[tuple[list[int], int]], concurrency: int,
               env: dict[str, str], dtype: str = "float32", engine_args: tuple[str, ...] = ()) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as logs:
        split = Split(model_dir, concurrency, env, Path(logs), dtype, engine_args=engine_args)
        try:
            return asyncio.run(_drive(split.port, work, concurrency))
        finally:
            split.stop()


def run_apis(model_dir: Path, work: list[tuple[list[int], int]], concurrency: int, rounds: int,
             dtype: str = "float32", smg: bool = False) -> dict[str, list[dict[str, Any]]]:
    """gRPC and HTTP/SSE against one frontend (HTTP on), and with `smg` HTTP/SSE through an SMG gateway in
    front of the same engine, alternating for `rounds` rounds."""
    runs: dict[str, list[dict[str, Any]]] = {"split, gRPC": [], "split, OpenAI HTTP/SSE": []}
    http_work: list[tuple[Any, int]] = list(work)
    if smg:  # SMG takes text prompts only: both HTTP runs send the prompts' text (tokenized by each)
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        http_work = [(tok.decode(prompt), out) for prompt, out in work]
        runs[SMG_RUN] = []
    with tempfile.TemporaryDirectory() as logs:
        split = Split(model_dir, concurrency, {}, Path(logs), dtype, http=True, smg=smg)
        try:
            http_runs = [("split, OpenAI HTTP/SSE", split.http_port)] + ([(SMG_RUN, split.smg_port)] if smg else [])
            for i in range(rounds):
                runs["split, gRPC"].append(asyncio.run(_drive(split.port, work, concurrency)))
                for name, port in http_runs[::-1] if i % 2 else http_runs:  # neither always runs first
                    before = split.cpu_seconds()
                    run = asyncio.run(_drive_http(port, http_work, concurrency, model_dir.name))
                    run["service_cpu"] = [b - a for a, b in zip(before, split.cpu_seconds())]
                    runs[name].append(run)
        finally:
            split.stop()
    return runs


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
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --tracing: off/on pairs to alternate; with --api grpc openai: gRPC/HTTP pairs")
    ap.add_argument("--api", nargs="+", choices=APIS, default=["grpc"],
                    help="the public API(s) to drive; 'grpc openai' compares them on one frontend")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--async-scheduling", nargs="+", choices=("off", "on"), default=None,
                    help="run the served part with the engine's async scheduling in each mode (alternating)")
    ap.add_argument("--smg", action="store_true",
                    help="with --api openai: also drive an SMG gateway in front of the same engine")
    add_workload_args(ap)
    args = ap.parse_args()
    if args.smg and "openai" not in args.api:
        ap.error("--smg compares HTTP/SSE through SMG with HTTP/SSE through tandem's frontend: add --api openai")
    if "openai" in args.api and args.tracing:
        ap.error("--tracing and --api openai are separate comparisons: run them one at a time")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, work = build_model_and_workload(tmp, args)
        print(f"workload: {len(work)} requests, prompt+output lengths U[{args.min_len},{args.max_len}], "
              f"model {describe_model(model_dir, args)}, {os.cpu_count()} CPUs, concurrency {args.concurrency}")
        for dtype in args.dtype:
            report(dtype, *measure(model_dir, work, args, dtype), args)
    return 0


def measure(model_dir: Path, work: list[tuple[list[int], int]], args: argparse.Namespace,
            dtype: str) -> tuple[dict[str, Any] | None, dict[str, list[dict[str, Any]]], int]:
    """(offline result, served runs by mode, spans received) for one dtype."""
    offline = None if args.skip_offline else run_tandem(model_dir, work, 1, dtype)
    if "openai" in args.api:
        runs = run_apis(model_dir, work, args.concurrency, args.rounds, dtype, smg=args.smg)
        if "grpc" not in args.api:
            del runs["split, gRPC"]
        return offline, runs, 0
    if args.async_scheduling:
        modes = {m: (f"--{'' if m == 'on' else 'no-'}async-scheduling",) for m in args.async_scheduling}
        runs = {f"split, async {m}": [] for m in modes}
        for i in range(args.rounds):
            for mode, flag in list(modes.items())[:: -1 if i % 2 else 1]:  # neither always goes first
                runs[f"split, async {mode}"].append(run_served(model_dir, work, args.concurrency, {}, dtype, flag))
        return offline, runs, 0
    runs = {"split, tracing off": [], "split, tracing on": []}
    spans = 0
    if args.tracing:
        from tests.observability.otlp_receiver import OtlpReceiver

        with OtlpReceiver() as receiver:
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "always_on"}
            for _ in range(args.rounds):  # alternate, so neither mode always runs first
                runs["split, tracing off"].append(run_served(model_dir, work, args.concurrency, {}, dtype))
                runs["split, tracing on"].append(run_served(model_dir, work, args.concurrency, env, dtype))
            spans = len(receiver.spans())
    else:
        runs["split, tracing off"].append(run_served(model_dir, work, args.concurrency, {}, dtype))
    return offline, runs, spans


def report(dtype: str, offline: dict[str, Any] | None, runs: dict[str, list[dict[str, Any]]], spans: int,
           args: argparse.Namespace) -> None:
    served = {name: sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2] for name, rs in runs.items() if rs}
    print(f"\n{dtype}:\n")
    print("| system | output tok/s | elapsed s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms | "
          "ITL p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    if offline is not None:
        print(f"| offline LLM (in-process) | {offline['tok_s']:.0f} | {offline['elapsed']:.2f} | - | - | - | "
              f"{offline.get('step_ms', float('nan')):.2f} (step) | - |")
    for name, r in served.items():
        print(row(name, r))
    if "split, OpenAI HTTP/SSE" in served:
        report_apis(offline, runs, served)
        return
    base = served.get("split, tracing off") or next(iter(served.values()))
    if "split, async on" in served and "split, async off" in served:
        on, off = served["split, async on"], served["split, async off"]
        pairs = ", ".join(f"{b['tok_s'] / a['tok_s']:.3f}" for a, b in zip(runs["split, async off"], runs["split, async on"]))
        spread = {m: f"{min(r['tok_s'] for r in runs[m]):.0f}-{max(r['tok_s'] for r in runs[m]):.0f}" for m in served}
        print(f"\nasync scheduling on / off (medians of {args.rounds} alternating rounds): throughput "
              f"{on['tok_s'] / off['tok_s']:.3f}x (per round: {pairs}; tok/s min-max: {spread}), ITL p50 "
              f"{1e3 * pct(on['itl'], 50):.2f} vs {1e3 * pct(off['itl'], 50):.2f} ms, TPOT p50 "
              f"{1e3 * statistics.median(on['tpot']):.2f} vs {1e3 * statistics.median(off['tpot']):.2f} ms")
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


def report_apis(offline: dict[str, Any] | None, runs: dict[str, list[dict[str, Any]]],
                served: dict[str, dict[str, Any]]) -> None:
    http = served["split, OpenAI HTTP/SSE"]
    if offline is not None:
        print(f"\nHTTP/SSE served / offline throughput = {http['tok_s'] / offline['tok_s']:.2f}")
    if "split, gRPC" in served:
        pairs = ", ".join(f"{b['tok_s'] / a['tok_s']:.2f}"
                          for a, b in zip(runs["split, gRPC"], runs["split, OpenAI HTTP/SSE"]))
        print(f"HTTP/SSE / gRPC throughput (medians of {len(runs['split, gRPC'])} alternating rounds) = "
              f"{http['tok_s'] / served['split, gRPC']['tok_s']:.2f} (per round: {pairs})")
    if SMG_RUN in served:
        pairs = ", ".join(f"{b['tok_s'] / a['tok_s']:.2f}" for a, b in zip(runs["split, OpenAI HTTP/SSE"], runs[SMG_RUN]))
        print(f"SMG gateway / tandem frontend throughput, HTTP/SSE on the same engine (medians of "
              f"{len(runs[SMG_RUN])} alternating rounds) = {served[SMG_RUN]['tok_s'] / http['tok_s']:.2f} "
              f"(per round: {pairs})")
    if SMG_RUN in served:  # the work each path costs the services, less sensitive to neighbours than time
        per_k = {name: [1e3 * statistics.median(r["service_cpu"][i] / r["tokens"] for r in rs) for i in range(3)]
                 for name, rs in runs.items() if name != "split, gRPC"}
        front, gate = per_k["split, OpenAI HTTP/SSE"], per_k[SMG_RUN]
        print(f"service CPU s per 1000 output tokens (medians): frontend path engine {front[0]:.2f} + frontend "
              f"{front[1]:.2f} = {front[0] + front[1]:.2f}; SMG path engine {gate[0]:.2f} + smg {gate[2]:.2f} = "
              f"{gate[0] + gate[2]:.2f}")
    cpu = ", ".join(f"{name.removeprefix('split, ')} {statistics.median(r['client_cpu'] for r in rs):.2f} s"
                    for name, rs in runs.items())
    print(f"benchmark client CPU per run (it shares the cores with the services): {cpu}")


if __name__ == "__main__":
    sys.exit(main())
