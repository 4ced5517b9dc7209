"""Routing benchmark: N engines behind one or more frontends on a multi-turn chat workload, per policy.

Workload: a shared system prompt, `--conversations` conversations of `--turns` turns each, arriving in
uneven bursts; each turn is the conversation's whole history (system prompt, earlier user messages and
the replies the engines gave) plus a new user message, sent as token ids (greedy, `--reply-tokens`
tokens, ignore_eos) after a random think time. With several frontends each turn goes to a random one, as
a load balancer in front of them would send it.

Every engine has prefix caching on and `--kv-fraction` (default 1/3) of the KV blocks the conversations'
histories need at once (their distinct full blocks at the end of the run), so one engine cannot hold
every conversation. The reference is the same workload on ONE engine holding all the cluster's blocks
(and all its sequences), where nothing needs to be evicted: its prefix-cache hit rate is what routing
can at best preserve.

Printed per run: the prefix-cache hit rate summed over the engines (hits / queries from their Prometheus
counters `tandem_prefix_cache_hits_total` / `_queries_total`), its ratio to the one-big-engine rate,
each engine's share of the prompt tokens (`tandem_prefix_cache_queries_total`) and the largest share
over the fair share, TTFT and ITL p50/p99 measured by the client, and the run's wall time. Policies:
cache-aware (with one frontend and with two), least-load, prefix. On a small CPU box the engines, the
frontends and this client share the cores: read TTFT/ITL as a comparison within one run.

    python bench/routing.py                          # 4 engines, the done-when workload
    python bench/routing.py --engines 2 --conversations 16 --turns 3 --policies cache-aware least-load
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import grpc  # noqa: E402
from serve import free_port, pct, wait_serving  # noqa: E402
from tandem.v1 import generation_pb2 as pb  # noqa: E402
from tandem.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

BLOCK_SIZE = 16
RUNS = {  # name -> (policy, frontends, one big engine)
    "one big engine": ("least-load", 1, True),
    "cache-aware": ("cache-aware", 1, False),
    "cache-aware, 2 frontends": ("cache-aware", 2, False),
    "least-load": ("least-load", 1, False),
    "prefix": ("prefix", 1, False),
}


# ---- the workload -------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Conversation:
    start_s: float
    user_turns: list[list[int]]
    think_s: list[float]  # pause before each turn after the first
    frontend_picks: list[int]  # which frontend each turn goes to (modulo the number of frontends)


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[Conversation]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(10, vocab) for _ in range(args.system_tokens)]
    conversations, t = [], 0.0
    mean_gap = args.arrival_window / args.conversations
    for _ in range(args.conversations):
        t += rng.expovariate(1 / mean_gap) * rng.choice((0.1, 0.1, 0.1, 3.0))  # bursts, then lulls
        turns = [[rng.randrange(10, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)]
        think = [rng.expovariate(1 / args.think_time) for _ in range(args.turns - 1)]
        conversations.append(Conversation(t, turns, think, [rng.randrange(64) for _ in range(args.turns)]))
    return system, conversations


def blocks_needed(args: argparse.Namespace, conversations: int) -> int:
    """Distinct full KV blocks of `conversations` histories at their end: the system prompt's once, each
    conversation's own (its last reply's final token is never computed)."""
    history = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens) - 1
    shared = args.system_tokens // BLOCK_SIZE
    return shared + conversations * (history // BLOCK_SIZE - shared)


def peak_overlap(lives: list[tuple[float, float]]) -> int:
    """The most conversations alive (first turn sent, last reply not yet received) at one time."""
    edges = sorted([(start, 1) for start, _ in lives] + [(end, -1) for _, end in lives])
    alive = peak = 0
    for _, step in edges:
        alive += step
        peak = max(peak, alive)
    return peak


# ---- processes --------------------------------------------------------------------------------------------
class Cluster:
    """Engines and frontends on loopback ports; stopped with SIGTERM."""

    def __init__(self, model_dir: Path, log_dir: Path, num_engines: int, blocks: int, max_num_seqs: int,
                 policy: str, num_frontends: int) -> None:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
               "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.procs: list[subprocess.Popen[bytes]] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        self.engine_ports = [free_port() for _ in range(num_engines)]
        self.metrics_ports = [free_port() for _ in range(num_engines)]
        for i, (port, metrics) in enumerate(zip(self.engine_ports, self.metrics_ports)):
            self._start(["engine_svc.cli", "--model", str(model_dir), "--host", "127.0.0.1",
                         "--port", str(port), "--metrics-port", str(metrics), "--dtype", "float32",
                         "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(blocks),
                         "--max-num-seqs", str(max_num_seqs), "--max-waiting", "-1", "--log-level", "WARNING"],
                        env, log_dir / f"engine-{i}.log")
        for port, proc in zip(self.engine_ports, self.procs):
            wait_serving(port, proc)
        engines = ",".join(f"127.0.0.1:{p}" for p in self.engine_ports)
        self.frontend_ports = [free_port() for _ in range(num_frontends)]
        for i, port in enumerate(self.frontend_ports):
            self._start(["frontend_svc.cli", "--engine", engines, "--routing", policy, "--host", "127.0.0.1",
                         "--port", str(port), "--metrics-port", "0", "--max-concurrent-requests", "4096",
                         "--log-level", "WARNING"], env, log_dir / f"frontend-{i}.log")
        for port, proc in zip(self.frontend_ports, self.procs[num_engines:]):
            wait_serving(port, proc)

    def _start(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        with log.open("ab") as out:
            self.procs.append(subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env, stdout=out,
                                               stderr=subprocess.STDOUT))

    def engine_counters(self) -> list[dict[str, float]]:
        """Each engine's Prometheus counters (hits, queries)."""
        out = []
        for port in self.metrics_ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
                text = answer.read().decode()
            out.append({name: _metric(text, f"tandem_prefix_cache_{name}_total") for name in ("hits", "queries")})
        return out

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{name} not found in the engine's /metrics")
    return float(match[1])


# ---- the client ---------------------------------------------------------------------------------------------
async def converse(stubs: list[Any], system: list[int], c: Conversation, reply_tokens: int, t0: float,
                   stats: dict[str, list[Any]]) -> None:
    await asyncio.sleep(max(0.0, t0 + c.start_s - time.perf_counter()))
    began = time.perf_counter()
    history = list(system)
    for turn, user in enumerate(c.user_turns):
        if turn:
            await asyncio.sleep(c.think_s[turn - 1])
        prompt = history + user
        request = pb.GenerateRequest(sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=reply_tokens,
                                                                       ignore_eos=True))
        request.token_ids.ids.extend(prompt)
        start, last, reply = time.perf_counter(), None, []
        async for response in stubs[c.frontend_picks[turn] % len(stubs)].Generate(request):
            if response.token_ids:
                now = time.perf_counter()
                if last is None:
                    stats["ttft"].append(now - start)
                else:
                    stats["itl"].append((now - last) / len(response.token_ids))
                last = now
                reply.extend(response.token_ids)
        assert len(reply) == reply_tokens, f"a turn produced {len(reply)} tokens"
        history = prompt + reply
    stats["lives"].append((began, time.perf_counter()))


async def drive(ports: list[int], system: list[int], conversations: list[Conversation],
                reply_tokens: int) -> dict[str, Any]:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
    try:
        stubs = [pb_grpc.GenerationServiceStub(ch) for ch in channels]
        stats: dict[str, list[Any]] = {"ttft": [], "itl": [], "lives": []}
        t0 = time.perf_counter()
        await asyncio.gather(*(converse(stubs, system, c, reply_tokens, t0, stats) for c in conversations))
        return {**stats, "elapsed": time.perf_counter() - t0}
    finally:
        for ch in channels:
            await ch.close()


def run(name: str, args: argparse.Namespace, model_dir: Path, blocks: int, workload: Any,
        log_dir: Path) -> dict[str, Any]:
    policy, frontends, big = RUNS[name]
    engines = 1 if big else args.engines
    cluster = Cluster(model_dir, log_dir / name.replace(" ", "_").replace(",", ""), engines,
                      blocks * args.engines if big else blocks,
                      args.max_num_seqs * args.engines if big else args.max_num_seqs, policy, frontends)
    try:
        before = cluster.engine_counters()
        result = asyncio.run(drive(cluster.frontend_ports, *workload, args.reply_tokens))
        after = cluster.engine_counters()
    finally:
        cluster.stop()
    grown = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    queries = [g["queries"] for g in grown]
    result["hit_rate"] = sum(g["hits"] for g in grown) / sum(queries)
    result["shares"] = [q / sum(queries) for q in queries]
    result["max_over_fair"] = max(result["shares"]) * len(queries)
    result["peak_alive"] = peak_overlap(result["lives"])
    return result


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, blocks: int, need: int) -> str:
    base = results.get("one big engine", {}).get("hit_rate")
    alive = min(r["peak_alive"] for r in results.values())
    lines = [
        f"{args.engines} engines x {blocks} KV blocks of {BLOCK_SIZE} tokens (all {args.conversations} histories "
        f"need {need} blocks: {blocks / need:.2f} of that per engine; at least {alive} conversations were alive at "
        f"once in every run, whose histories need {blocks_needed(args, alive)} blocks: "
        f"{blocks / blocks_needed(args, alive):.2f}); reference: one engine with {blocks * args.engines} blocks",
        f"workload: {args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens}, "
        f"user turns {args.user_tokens}, replies {args.reply_tokens} tokens; arrivals in bursts over "
        f"~{args.arrival_window:.0f}s, think time ~{args.think_time:.1f}s",
        "",
        "| run | hit rate | vs one big engine | prompt-token share per engine | max / fair share | "
        "TTFT p50 / p99 ms | ITL p50 / p99 ms | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = f"{r['hit_rate'] / base:.3f}x" if base else "-"
        shares = " / ".join(f"{s:.0%}" for s in r["shares"])
        lines.append(f"| {name} | {r['hit_rate']:.3f} | {ratio} | {shares} | {r['max_over_fair']:.2f}x | "
                     f"{1e3 * pct(r['ttft'], 50):.0f} / {1e3 * pct(r['ttft'], 99):.0f} | "
                     f"{1e3 * pct(r['itl'], 50):.1f} / {1e3 * pct(r['itl'], 99):.1f} | {r['elapsed']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=128)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--arrival-window", type=float, default=3.0, help="seconds over which conversations start")
    ap.add_argument("--think-time", type=float, default=1.5, help="mean seconds between a reply and the next turn")
    ap.add_argument("--kv-fraction", type=float, default=1 / 3,
                    help="each engine's KV blocks as a fraction of what the histories need at once")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--policies", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None, help="keep the services' logs here (default: a temporary directory)")
    args = ap.parse_args()

    from entrypoints.tiny_model import make_tiny_model

    need = blocks_needed(args, args.conversations)
    blocks = max(1, round(need * args.kv_fraction))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", seed=args.seed, vocab_size=1024)
        vocab = int(__import__("json").loads((model_dir / "config.json").read_text())["vocab_size"])
        workload = make_workload(args, vocab)
        for name in sorted(args.policies, key=list(RUNS).index):
            results[name] = run(name, args, model_dir, blocks, workload, Path(args.log_dir or tmp))
            print(f"{name}: hit rate {results[name]['hit_rate']:.3f} in {results[name]['elapsed']:.1f}s", flush=True)
    print()
    print(report(results, args, blocks, need))
    return 0


if __name__ == "__main__":
    sys.exit(main())
