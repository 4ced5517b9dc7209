"""What one anonymous client can still do to the other tenants of one `tandem-engine` + `tandem-frontend`
pair (a real model, `--model DIR`), measured from outside: the sibling of bench/edge.py for the attacks
of "Hardening III" (grammar compiles, retained garbage, big bodies, subscribers, stop strings).

A victim stream (gRPC Generate through the frontend, greedy, ignore_eos) runs through every attack; its
longest gap between responses during the attack is the stall the attack caused. Each attack gets a fresh
pair of services (`--attacks`, default all), so what one leaves behind never counts against the next:

- `grammar`: a JSON schema of `--schema-depth` nested objects and one of `--array-depth` nested arrays
  sent together as `structured_outputs.json`; then, every 5 s, another client's fresh regex request: how
  long until one compiles (and what the attacks were answered), the engine's peak RSS (its compile
  processes included).
- `rejected-prompt`: `--rejected` completions of a `--prompt-ids`-id prompt (refused: longer than the
  context): the frontend's RSS after the first and after the last. `rejected-parsed`: the same with a
  `--small-prompt-ids`-id prompt, which passes the body's pre-checks and is parsed before its refusal.
- `big-bodies`: a Responses body with `--items` input items, alone and eight at once; `/detokenize` and
  `/v1/completions` with `--prompt-ids` ids, eight at once: the victim's gap, the frontend's peak RSS.
- `smg-refused`: `--rounds` rounds of 40 concurrent SMG Generate calls (n=64, a 2,000-id prompt) sent
  straight to the engine, most refused RESOURCE_EXHAUSTED: the engine's RSS after each round.
- `subscribers`: the prefix cache filled with `--cached-blocks` blocks, then `--subscribers` unread
  SubscribeKvEvents streams and `--tokenizer-callers` unread GetTokenizer calls: how many were refused,
  the engine's RSS growth.
- `malformed`: `/tokenize` with JSON nested 30,000 levels (status, tracebacks in the frontend's log) and
  an SMG Generate whose bytes do not decode (status).
- `stop-strings`: 100 concurrent requests with 16 fresh 1,024-character stop strings each, through the
  frontend and through SMG: the victim's gap.
- `response-id`: a Responses request whose `previous_response_id` is 3 MB: the 404 body's size.

    python bench/edge_tenants.py --model .tiny-models/SmolLM2-135M-Instruct [--attacks grammar ...]

The gaps and RSS figures are wall-clock and memory on this machine: run it on a quiet box, or read them
beside the victim's own median gap, which each line prints.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import grpc  # noqa: E402
from edge import Pair, Victim, rss_bytes  # noqa: E402
from tandem.engine.v1 import engine_core_pb2 as epb  # noqa: E402
from tandem.vendor.smg import common_pb2 as cpb  # noqa: E402
from tandem.vendor.smg import vllm_engine_pb2 as vpb  # noqa: E402

ATTACKS = ("grammar", "rejected-prompt", "rejected-parsed", "big-bodies", "smg-refused", "subscribers", "malformed",
           "stop-strings", "response-id")
SMG = "/vllm.grpc.engine.VllmEngine/"
MiB = 2**20


def tree_rss(pid: int) -> int:
    """RSS of a process and all its descendants (an engine's compile processes count as the engine)."""
    total = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            total += rss_bytes(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


class PeakRss:
    """The peak of `tree_rss(pid)` while the `with` block runs (sampled every 20 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = self.peak = tree_rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def grown_mib(self) -> float:
        return (self.peak - self.before) / MiB


def post(port: int, path: str, body: bytes, timeout: float = 300.0) -> tuple[int, bytes, float]:
    """POST `body` as JSON; (status, response body, seconds). Status -1: the connection failed."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read(), time.monotonic() - t0
    except OSError as exc:
        return -1, repr(exc).encode(), time.monotonic() - t0
    finally:
        conn.close()


def served_model(pair: Pair) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", pair.http_port, timeout=30)
    try:
        conn.request("GET", "/v1/models")
        return str(json.loads(conn.getresponse().read())["data"][0]["id"])
    finally:
        conn.close()


def compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class Probe:
    """Pings a service every 10 ms on a thread of its own (the frontend: GET /health on one keep-alive
    connection; the engine: grpc.health Check); `worst(start, end)` is the slowest answer to a ping sent in
    [start, end]: how long that service's event loop was held, whatever the engine's step time."""

    def __init__(self, ping: Callable[[], None]) -> None:
        self.samples: list[tuple[float, float]] = []
        self._ping = ping
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @classmethod
    def http(cls, port: int) -> Probe:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def ping() -> None:
            conn.request("GET", "/health")
            conn.getresponse().read()

        return cls(ping)

    @classmethod
    def grpc_health(cls, port: int) -> Probe:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        return cls(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=60))

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            with contextlib.suppress(Exception):
                self._ping()
            self.samples.append((t0, time.monotonic() - t0))
            time.sleep(0.01)

    def worst(self, start: float, end: float) -> float:
        return max((latency for t, latency in self.samples if start <= t <= end), default=0.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


PROBES: dict[str, Probe] = {}  # "frontend", "engine": started with each pair


def during(victim: Victim, label: str, action: Callable[[], Any]) -> Any:
    """Run `action` while the victim streams; print the victim's longest gap (and its median before) and the
    slowest ping of each service's event loop."""
    start = time.monotonic()
    result = action()
    end = time.monotonic()
    time.sleep(0.5)  # let what the attack queued drain
    quiet_start = time.monotonic()
    time.sleep(min(end - start, 10.0))
    quiet = victim.gap(quiet_start, time.monotonic())
    print(f"  {label}: victim gap {1000 * victim.gap(start, end):.0f} ms over {end - start:.2f} s (its median "
          f"before: {1000 * victim.median_gap_before(start):.0f} ms; longest in a window as long without the "
          f"attack, after it: {1000 * quiet:.0f} ms); slowest ping: {probes(start, end)}", flush=True)
    return result


def probes(start: float, end: float) -> str:
    return ", ".join(f"{name} {1000 * probe.worst(start, end):.0f} ms" for name, probe in PROBES.items())


def concurrently(count: int, fn: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(fn, range(count)))


def statuses(results: list[tuple[int, bytes, float]]) -> str:
    counts: dict[int, int] = {}
    for status, _, _ in results:
        counts[status] = counts.get(status, 0) + 1
    return ", ".join(f"{n} x {s}" for s, n in sorted(counts.items()))


def engine_metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    if not args.engine_token_file:
        return []
    return [("authorization", "Bearer " + Path(args.engine_token_file).read_text().split()[0])]


# ---- 1. grammar compiles ---------------------------------------------------------------------------------

def nested_objects(depth: int) -> str:
    return '{"type":"object","required":["a"],"properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth


def nested_arrays(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


def attack_grammar(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    port = pair.http_port
    bodies = [compact({"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": s}})
              for s in (nested_objects(args.schema_depth), nested_arrays(args.array_depth))]
    print(f"  attack bodies: {', '.join(f'{len(b) / 1e3:.0f} KB' for b in bodies)}")
    with PeakRss(pair.engine.pid) as rss:
        start = time.monotonic()
        attacks: list[Any] = [None, None]
        threads = [threading.Thread(target=lambda i=i: attacks.__setitem__(i, post(port, "/v1/completions", bodies[i])))
                   for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        tries = []
        while time.monotonic() - start < args.grammar_wait:
            regex = f"[0-9]{{{len(tries) + 1}}}-{random.randrange(10**6)}"  # fresh: never a cache hit
            sent = time.monotonic() - start
            status, _body, seconds = post(port, "/v1/completions", compact(
                {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": regex}}), timeout=120)
            tries.append((sent, status, seconds))
            if status == 200:
                break
            time.sleep(max(0.0, 5.0 - seconds))
        for t in threads:
            t.join(args.grammar_wait)
        end = time.monotonic()
    for label, result in zip(("objects", "arrays"), attacks):
        if result is not None:
            detail = json.loads(result[1]).get("error", {}).get("message", "")[:100] if result[0] != 200 else ""
            print(f"  {label} schema -> {result[0]} in {result[2]:.2f} s {detail!r}")
    for at, status, seconds in tries:
        print(f"  another client's regex request sent at {at:.1f} s -> {status} in {seconds:.2f} s")
    ok = tries and tries[-1][1] == 200
    print(f"  other clients' structured requests failed for {tries[-1][0] - 1.0 if ok else end - start:.1f} s"
          f"{'' if ok else ' (still failing at the end)'}; engine peak RSS +{rss.grown_mib:.0f} MiB "
          f"(from {rss.before / MiB:.0f}); victim gap {1000 * victim.gap(start, end):.0f} ms; slowest ping: "
          f"{probes(start, end)}")


# ---- 2. rejected prompts kept by the frontend ------------------------------------------------------------

def attack_rejected_prompt(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    rejected_prompts(pair, args, victim, args.prompt_ids)


def attack_rejected_parsed(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    rejected_prompts(pair, args, victim, args.small_prompt_ids)


def rejected_prompts(pair: Pair, args: argparse.Namespace, victim: Victim, ids: int) -> None:
    body = compact({"prompt": [5] * ids, "max_tokens": 4})
    before = rss_bytes(pair.frontend.pid)
    first = post(pair.http_port, "/v1/completions", body)
    time.sleep(0.5)
    after_one = rss_bytes(pair.frontend.pid)
    times = [first[2]]
    start = time.monotonic()
    for _ in range(args.rejected - 1):
        times.append(post(pair.http_port, "/v1/completions", body)[2])
    end = time.monotonic()
    time.sleep(0.5)
    quiet_start = time.monotonic()
    time.sleep(max(2.0, min(end - start, 10.0)))
    quiet = victim.gap(quiet_start, time.monotonic())
    after = rss_bytes(pair.frontend.pid)
    print(f"  {len(body) / 1e6:.1f} MB body -> {first[0]} ({json.loads(first[1])['error']['message'][:80]!r}), "
          f"median {1000 * sorted(times)[len(times) // 2]:.0f} ms each")
    print(f"  frontend RSS {before / MiB:.0f} MiB before, {after_one / MiB:.0f} after 1, {after / MiB:.0f} after "
          f"{args.rejected} (+{(after - after_one) / MiB:.0f} MiB over the first); victim gap "
          f"{1000 * victim.gap(start, end):.0f} ms over {end - start:.1f} s (in a window as long without the "
          f"attack, after it: {1000 * quiet:.0f} ms); slowest ping: {probes(start, end)}")


# ---- 3. big parseable bodies ------------------------------------------------------------------------------

def attack_big_bodies(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    port = pair.http_port
    responses = compact({"model": served_model(pair), "input": [{"role": "user", "content": "x"}] * args.items})
    ids = [5] * args.prompt_ids
    cases = [
        ("1 x Responses", 1, "/v1/responses", responses),
        ("8 x Responses", 8, "/v1/responses", responses),
        ("8 x /detokenize", 8, "/detokenize", compact({"tokens": ids})),
        ("8 x completions", 8, "/v1/completions", compact({"prompt": ids, "max_tokens": 4})),
    ]
    for label, count, path, body in cases:
        with PeakRss(pair.frontend.pid) as rss:
            results = during(victim, f"{label} ({len(body) / 1e6:.1f} MB each)",
                             lambda count=count, path=path, body=body: concurrently(count, lambda _: post(port, path, body)))
        print(f"    answered {statuses(results)}; frontend peak RSS +{rss.grown_mib:.0f} MiB", flush=True)
        time.sleep(1.0)


# ---- 4. refused SMG calls kept by the engine ---------------------------------------------------------------

def smg_call(channel: grpc.Channel, method: str, response: Any, stream: bool = True) -> Any:
    make = channel.unary_stream if stream else channel.unary_unary
    return make(SMG + method, request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response.FromString)


def attack_smg_refused(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(2000)]
    metadata = engine_metadata(args)
    rows = []
    with grpc.insecure_channel(f"127.0.0.1:{pair.engine_port}") as channel:
        generate = smg_call(channel, "Generate", vpb.GenerateResponse)

        def one(i: int, round_: int) -> str:
            request = vpb.GenerateRequest(request_id=f"r{round_}-{i}", tokenized=vpb.TokenizedInput(input_ids=prompt),
                                          sampling_params=vpb.SamplingParams(n=64, max_tokens=1, temperature=1.0))
            try:
                for _ in generate(request, timeout=120, metadata=metadata):
                    pass
                return "OK"
            except grpc.RpcError as exc:
                return exc.code().name

        before = rss_bytes(pair.engine.pid)
        start = time.monotonic()
        for round_ in range(args.rounds):
            codes = concurrently(40, lambda i, r=round_: one(i, r))
            time.sleep(0.3)
            rows.append((codes.count("RESOURCE_EXHAUSTED"), rss_bytes(pair.engine.pid)))
        end = time.monotonic()
    print(f"  refused per round: {[r for r, _ in rows]}")
    print(f"  engine RSS {before / MiB:.0f} MiB before, after each round: "
          f"{', '.join(f'{m / MiB:.0f}' for _, m in rows)} (+{(rows[-1][1] - rows[0][1]) / MiB:.0f} MiB from "
          f"round 1 to {args.rounds}); victim gap {1000 * victim.gap(start, end):.0f} ms; slowest ping: "
          f"{probes(start, end)}")


# ---- 5. unread subscribers -------------------------------------------------------------------------------

def fill_prefix_cache(pair: Pair, blocks: int, block_size: int = 16) -> None:
    """Prefill distinct prompts (max_tokens 1) until about `blocks` blocks are cached."""
    rng = random.Random(1)
    per = 1024
    prompts = [[rng.randrange(100, 40000) for _ in range(per)] for _ in range(max(1, blocks * block_size // per))]
    for i in range(0, len(prompts), 4):
        concurrently(len(prompts[i:i + 4]), lambda j, i=i: post(
            pair.http_port, "/v1/completions", compact({"prompt": prompts[i + j], "max_tokens": 1})))


def attack_subscribers(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    fill_prefix_cache(pair, args.cached_blocks)
    metadata = engine_metadata(args)
    channel = grpc.insecure_channel(f"127.0.0.1:{pair.engine_port}")
    subscribe = channel.unary_stream("/tandem.engine.v1.EngineCoreService/SubscribeKvEvents",
                                     request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=epb.KvEventBatch.FromString)
    tokenizer = channel.unary_stream("/tandem.engine.v1.EngineCoreService/GetTokenizer",
                                     request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=epb.TokenizerChunk.FromString)
    smg_tokenizer = smg_call(channel, "GetTokenizer", cpb.GetTokenizerChunk)

    def refused(calls: list[Any]) -> int:
        time.sleep(2.0)  # a refused call has ended by now; an accepted one is still open (unread)
        return sum(1 for c in calls if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)

    start = time.monotonic()
    base = rss_bytes(pair.engine.pid)
    subs = [subscribe(epb.SubscribeKvEventsRequest(), timeout=600, metadata=metadata) for _ in range(args.subscribers)]
    n_sub_refused = refused(subs)
    after_subs = rss_bytes(pair.engine.pid)
    toks = [(tokenizer if i % 2 else smg_tokenizer)(epb.GetTokenizerRequest() if i % 2 else cpb.GetTokenizerRequest(),
                                                     timeout=600, metadata=metadata)
            for i in range(args.tokenizer_callers)]
    n_tok_refused = refused(toks)
    after_toks = rss_bytes(pair.engine.pid)
    end = time.monotonic()
    print(f"  {args.subscribers} unread SubscribeKvEvents ({args.cached_blocks} blocks cached): {n_sub_refused} "
          f"refused, engine RSS +{(after_subs - base) / MiB:.1f} MiB "
          f"({(after_subs - base) / MiB / max(1, args.subscribers - n_sub_refused):.2f} MiB per open one)")
    print(f"  {args.tokenizer_callers} unread GetTokenizer (half SMG): {n_tok_refused} refused, engine RSS "
          f"+{(after_toks - after_subs) / MiB:.1f} MiB; victim gap {1000 * victim.gap(start, end):.0f} ms; "
          f"slowest ping: {probes(start, end)}")
    for call in subs + toks:
        call.cancel()
    channel.close()


# ---- 6. malformed input ----------------------------------------------------------------------------------

def attack_malformed(pair: Pair, args: argparse.Namespace, victim: Victim, log_dir: Path) -> None:
    log = log_dir / "frontend.log"
    before = log.read_text(errors="replace").count("Traceback") if log.exists() else 0
    nested = b'{"prompt":' + b"[" * 30000 + b"]" * 30000 + b"}"
    status, body, seconds = post(pair.http_port, "/tokenize", nested)
    time.sleep(0.5)
    tracebacks = log.read_text(errors="replace").count("Traceback") - before if log.exists() else 0
    print(f"  /tokenize with JSON nested 30,000 levels -> {status} in {1000 * seconds:.0f} ms "
          f"({body[:100]!r}); {tracebacks} tracebacks in the frontend's log")
    with grpc.insecure_channel(f"127.0.0.1:{pair.engine_port}") as channel:
        raw = channel.unary_stream(SMG + "Generate", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        try:
            list(raw(b"\xff\xff\xff\xff", timeout=10, metadata=engine_metadata(args)))
            print("  SMG Generate with undecodable bytes -> OK (!)")
        except grpc.RpcError as exc:
            print(f"  SMG Generate with undecodable bytes -> {exc.code().name}: {exc.details()[:100]!r}")


# ---- 7. fresh stop strings ---------------------------------------------------------------------------------

def fresh_stops(rng: random.Random) -> list[str]:
    return ["".join(rng.choice("abcdefghij") for _ in range(1024)) for _ in range(16)]


def attack_stop_strings(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    """Each burst runs twice: first without stop strings (the control: what 100 concurrent small requests
    cost the victim anyway, their prefill batched into its steps), then with 16 fresh 1,024-char stop
    strings each; the difference is what the stop strings cost."""
    from tandem.v1 import generation_pb2 as pb
    from tandem.v1 import generation_pb2_grpc as pb_grpc

    rng = random.Random(2)
    with grpc.insecure_channel(f"127.0.0.1:{pair.port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for label, stops in (("without stop strings (control)", [[] for _ in range(100)]),
                             ("x 16 fresh 1,024-char stop strings", [fresh_stops(rng) for _ in range(100)])):

            def frontend(i: int, stops: list[list[str]] = stops) -> str:
                params = pb.SamplingParams(temperature=0, max_tokens=4, stop=stops[i])
                try:
                    list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 504, 3458, 282]),
                                                          sampling_params=params), timeout=120))
                    return "OK"
                except grpc.RpcError as exc:
                    return exc.code().name

            codes = during(victim, f"100 requests {label} through the frontend", lambda: concurrently(100, frontend))
            print(f"    answered {sorted(set(codes))}")
    with grpc.insecure_channel(f"127.0.0.1:{pair.engine_port}") as channel:
        generate = smg_call(channel, "Generate", vpb.GenerateResponse)
        metadata = engine_metadata(args)
        for label, stops in (("without stop strings (control)", [[] for _ in range(100)]),
                             ("x 16 fresh 1,024-char stop strings", [fresh_stops(rng) for _ in range(100)])):

            def smg(i: int, stops: list[list[str]] = stops) -> str:
                request = vpb.GenerateRequest(request_id=f"stop-{len(stops[i])}-{i}", tokenized=vpb.TokenizedInput(input_ids=[1, 504, 3458]),
                                              sampling_params=vpb.SamplingParams(max_tokens=4, stop=stops[i]))
                try:
                    list(generate(request, timeout=120, metadata=metadata))
                    return "OK"
                except grpc.RpcError as exc:
                    return exc.code().name

            codes = during(victim, f"100 requests {label} through SMG", lambda: concurrently(100, smg))
            print(f"    answered {sorted(set(codes))}")


# ---- 8. the echoed response id ---------------------------------------------------------------------------

def attack_response_id(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    huge = "resp_" + "a" * 3_000_000
    status, body, _seconds = post(pair.http_port, "/v1/responses",
                                 compact({"model": served_model(pair), "input": "hi", "previous_response_id": huge}))
    message = json.loads(body)["error"]["message"] if status != 200 else ""
    print(f"  previous_response_id of {len(huge) / 1e6:.0f} MB -> {status}, a {len(body):,}-byte body "
          f"(message {len(message):,} characters: {re.sub('a{20,}', 'a...', message)[:120]!r})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    ap.add_argument("--engine-args", default="", help="extra engine flags, one string")
    ap.add_argument("--engine-token-file", default=None)
    ap.add_argument("--schema-depth", type=int, default=800)
    ap.add_argument("--array-depth", type=int, default=1000)
    ap.add_argument("--grammar-wait", type=float, default=150.0, help="seconds to keep trying the other client")
    ap.add_argument("--prompt-ids", type=int, default=1_900_000)
    ap.add_argument("--rejected", type=int, default=80)
    ap.add_argument("--attacker-nice", type=int, default=0,
                    help="run the attacking client's threads at this nice value (the services and the victim "
                         "keep theirs): an attacker elsewhere takes none of the servers' cores")
    ap.add_argument("--small-prompt-ids", type=int, default=140_000)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--cached-blocks", type=int, default=2048)
    ap.add_argument("--subscribers", type=int, default=200)
    ap.add_argument("--tokenizer-callers", type=int, default=200)
    args = ap.parse_args()
    import shlex

    engine_args = shlex.split(args.engine_args)
    if args.engine_token_file:
        engine_args += ["--engine-token-file", args.engine_token_file]
    for name in args.attacks:
        print(f"{name}:", flush=True)
        with tempfile.TemporaryDirectory() as logs:
            pair = Pair(args.model, engine_args, Path(logs))
            try:
                victim = Victim(pair.port)
                PROBES.update(frontend=Probe.http(pair.http_port), engine=Probe.grpc_health(pair.engine_port))
                # The attack's own threads (created from here on) at a lower priority: on a 2-core box the
                # attacker's client otherwise takes the CPU the engine's steps need, which a remote
                # attacker could not.
                os.setpriority(os.PRIO_PROCESS, 0, args.attacker_nice)
                try:
                    if name == "malformed":
                        attack_malformed(pair, args, victim, Path(logs))
                    else:
                        globals()[f"attack_{name.replace('-', '_')}"](pair, args, victim)
                finally:
                    os.setpriority(os.PRIO_PROCESS, 0, 0)  # the next attack's services start at the default
                    victim.close()
                    for probe in PROBES.values():
                        probe.close()
            finally:
                pair.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
