"""What request migration costs: the gap a moved stream sees, and the cost of the feature when nothing fails.

Two engines (TP 1, CPU) behind one frontend; `--streams` greedy streams with `--prompt-len`-token random
prompts and `--max-tokens` outputs (ignore_eos), started together and split between the engines by
least-load routing. After `--kill-after` tokens of every stream the busier engine is killed (kill -9).

The gap of a moved stream is the time from the last token it got before the kill to the first token after
it. It splits into (from the frontend's log, same clock): detection (the kill to the frontend noticing the
stream broke), re-admission (noticing to the continuation sent to the other engine), and the rest, which
is the continuation's queueing and re-prefill of prompt + output on the other engine plus its first decode.
`--prefix-caching on` warms the other engine's cache with the same prompts first (the prefix of a moved
request is likely cached elsewhere, as cache-aware routing would find it); `off` runs without a cache.

`--cost` measures the feature when nothing fails: the same workload through a frontend with migration on
(`--max-migrations 3`) and off (`0`), alternating for `--rounds` rounds, output tokens per second.

    python bench/migration.py --model .tiny-models/SmolLM2-135M-Instruct [--prefix-caching on off] [--cost]
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from tandem.engine.v1 import engine_core_pb2 as epb  # noqa: E402
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc  # noqa: E402
from tandem.v1 import generation_pb2 as pb  # noqa: E402
from tandem.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

from frontend_svc.client import generate_request  # noqa: E402
from tests.support import Service, free_port, wait_until  # noqa: E402

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def start(model: Path, log_dir: Path, caching: bool, max_migrations: int) -> tuple[list[Service], Service]:
    flags = ["--dtype", "float32", "--max-num-seqs", "32", "--metrics-port", "0",
             "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    engines = [Service("engine", [sys.executable, "-m", "engine_svc.cli", "--model", str(model), "--host",
                                  "127.0.0.1", "--port", str(port), *flags], port, log_dir).start()
               for port in (free_port(), free_port())]
    port = free_port()
    front = Service("frontend", [sys.executable, "-m", "frontend_svc.cli", "--model", str(model), "--host",
                                 "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--routing", "least-load",
                                 "--engine", ",".join(e.address for e in engines),
                                 "--max-migrations", str(max_migrations)], port, log_dir).start()
    for s in (*engines, front):
        s.wait_serving(300)
    return engines, front


def running(engine: Service) -> int:
    with grpc.insecure_channel(engine.address) as channel:
        load = epb_grpc.EngineCoreServiceStub(channel).GetLoad(epb.GetLoadRequest(), timeout=5)
    return int(load.num_running + load.num_waiting)


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]


def stream_all(api: Any, requests: list[pb.GenerateRequest], on_all_at: int | None,
               midway: Any = None) -> list[list[float]]:
    """Each stream's token arrival times (one per token); `midway` runs once every stream has `on_all_at`
    tokens (the streams keep being read meanwhile)."""
    arrivals: list[list[float]] = [[] for _ in requests]
    count_lock = threading.Lock()
    reached = [0]
    everyone = threading.Event()

    def one(i: int) -> None:
        counted = on_all_at is None
        for response in api.Generate(requests[i], timeout=600):
            now = time.time()
            arrivals[i] += [now] * len(response.token_ids)
            if not counted and len(arrivals[i]) >= (on_all_at or 0):
                counted = True
                with count_lock:
                    reached[0] += 1
                    if reached[0] == len(requests):
                        everyone.set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    if on_all_at is not None:
        everyone.wait(timeout=300)
        midway()
    for t in threads:
        t.join()
    return arrivals


def log_times(text: str, needle: str) -> list[float]:
    out = []
    for line in text.splitlines():
        m = LOG_TIME.match(line)
        if m and needle in line:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def gap_run(args: argparse.Namespace, caching: bool) -> dict[str, list[float]]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-migration-"))
    engines, front = start(args.model, log_dir, caching, 3)
    try:
        with grpc.insecure_channel(front.address) as channel:
            api = pb_grpc.GenerationServiceStub(channel)
            vocab = api.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size
            ids = prompts(args, vocab)
            requests = [generate_request(token_ids=p, max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
                        for p in ids]
            if caching:  # every prompt computed once on each engine: a moved request finds its prefix cached
                for e in engines:
                    with grpc.insecure_channel(e.address) as ch:
                        stub = epb_grpc.EngineCoreServiceStub(ch)
                        info = stub.GetEngineInfo(epb.GetEngineInfoRequest(), timeout=10)
                    assert info.enable_prefix_caching
                warm = [generate_request(token_ids=p, max_tokens=1, temperature=0.0) for p in ids]
                for _ in range(2):  # least-load spreads each round over both engines
                    stream_all(api, warm, None)
            killed: list[float] = []

            def kill() -> None:
                victim = max(engines, key=running)
                killed.append(time.time())
                victim.kill(signal.SIGKILL)

            arrivals = stream_all(api, requests, args.kill_after, kill)
        t_kill = killed[0]
        log = front.log_path.read_text(errors="replace")
        noticed = [t for t in log_times(log, "went away") if t >= t_kill - 0.01]
        moved = [t for t in log_times(log, "moved from engine") if t >= t_kill - 0.01]
        gaps = []
        first_move = moved[0] if moved else t_kill
        for times in arrivals:  # a moved stream gets nothing between the kill and its continuation
            before = [t for t in times if t <= t_kill]
            after = [t for t in times if t > t_kill]
            if before and after and after[0] >= first_move:
                gaps.append(after[0] - before[-1])
        detection = (noticed[0] - t_kill) if noticed else float("nan")
        readmission = (moved[-1] - noticed[0]) if moved and noticed else float("nan")
        rest = [after[0] - moved[-1] for after in ([t for t in times if t > t_kill] for times in arrivals)
                if moved and after and after[0] >= first_move]
        return {"gap": gaps, "detection": [detection], "readmission": [readmission], "prefill": rest,
                "moved": [float(len(moved))]}
    finally:
        front.stop()
        for e in engines:
            e.stop()


def throughput(args: argparse.Namespace, max_migrations: int) -> float:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-migration-cost-"))
    engines, front = start(args.model, log_dir, True, max_migrations)
    try:
        with grpc.insecure_channel(front.address) as channel:
            api = pb_grpc.GenerationServiceStub(channel)
            vocab = api.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size
            requests = [generate_request(token_ids=p, max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
                        for p in prompts(args, vocab)]
            wait_until(lambda: api.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_ready_engines == 2, 60)
            begin = time.time()
            arrivals = stream_all(api, requests, None)
            return sum(map(len, arrivals)) / (time.time() - begin)
    finally:
        front.stop()
        for e in engines:
            e.stop()


def fmt(values: list[float]) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "n/a"
    return f"median {statistics.median(values) * 1e3:.0f} ms (min {min(values) * 1e3:.0f}, max {max(values) * 1e3:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--kill-after", type=int, default=48)
    parser.add_argument("--prefix-caching", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--cost", action="store_true", help="also: throughput with migration on vs off")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{args.streams} streams x {args.prompt_len}-token prompts, {args.max_tokens} tokens, kill -9 of the "
          f"busier engine after {args.kill_after} tokens of each; model {args.model.name}")
    for mode in args.prefix_caching:
        r = gap_run(args, mode == "on")
        print(f"prefix caching {mode}: {int(r['moved'][0])} streams moved; gap {fmt(r['gap'])}; "
              f"detection {fmt(r['detection'])}, re-admission {fmt(r['readmission'])}, "
              f"queue + re-prefill + first decode {fmt(r['prefill'])}")
    if args.cost:
        on, off = [], []
        for _ in range(args.rounds):
            on.append(throughput(args, 3))
            off.append(throughput(args, 0))
        ratios = [a / b for a, b in zip(on, off)]
        print(f"nothing failing, tok/s: migration on {statistics.median(on):.0f} {[round(x) for x in on]}, off "
              f"{statistics.median(off):.0f} {[round(x) for x in off]}; on/off median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
