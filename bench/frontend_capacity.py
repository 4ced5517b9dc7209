"""Frontend capacity: the CPU the frontend spends per streamed token, with the engine taken out of the way.

Three kinds of processes, each on its own:
- engine: tests/fake_engine.py's `FakeEngine` on a real gRPC `EngineCoreService` endpoint, emitting a
  fixed English passage (SmolLM2 tokens, a few multi-byte characters) one token per request per step, a
  step every `--step-ms` on the engine's own clock (the steps that queue while a message is written go
  out together, as the real engine's server does, engine_svc/api/server.py), in one of two regimes
  (`--regime`):
  capacity (default, 2 ms): 128 streams are offered 64k tok/s, more than one frontend core takes, so the
    frontend is saturated and falls behind: what it then costs per token is what one frontend core
    sustains at its limit (tok/msg > 1: the frontend sends several steps per message, never holding any);
  kept-up (40 ms: 3.2k tok/s): the frontend keeps up, every token goes out alone (tok/msg = 1.00);
- frontend: the real `tandem-frontend` process with SmolLM2-135M-Instruct's tokenizer (the GGUF file
  `make install` puts in the environment), `--http-port`, and its defaults otherwise (Prometheus metrics on);
- clients: `--clients` processes sharing `--streams` concurrent streams of `--tokens` tokens each (a chat
  prompt, greedy). gRPC clients keep each response as raw bytes and parse only the last one (its usage);
  SSE clients read the raw HTTP response and parse only the usage chunk, so the clients stay cheap.

`--apis grpc-node` runs the same gRPC streams from Node clients instead (bench/grpc_load_client.js,
@grpc/grpc-js from `make install`'s node_modules; one Node process per client process), to tell the
frontend's cost from the Python grpc.aio client's on this shared box.

For each API (gRPC `Generate`; OpenAI `/v1/chat/completions` with stream: true over SSE) and each case
(plain; 4 stop strings that never match; top-5 logprobs; both) it prints

    frontend us/tok   CPU time (user + system) of the frontend process during the run / tokens delivered
    client us/tok     the same for all client processes together (they must not be the bottleneck)
    engine us/tok     the same for the fake engine
    tok/msg           tokens delivered per response message (gRPC) or SSE event: 1.0 means every token went
                      out on its own (the frontend and its clients kept up); more, that steps were merged
    tok/s             tokens delivered per second of wall time
    stream ms         a stream's time from its request to its last byte, as its client saw it (median)
    first ms          gRPC: to its first response (median; an SSE stream's first event is the role chunk)

Tokens delivered = the completion_tokens of each stream's final usage. Rounds alternate APIs and cases
so that drift on a noisy machine does not favour one; the summary is the median over rounds.

    python bench/frontend_capacity.py [--regime capacity|kept-up] [--step-ms MS] [--streams 128] [--tokens 256] [--clients 4] [--rounds 3]
        [--apis grpc openai] [--cases plain stop logprobs stop+logprobs] [--stream-interval N [N ...]]
        [--pin] [--baseline DIR [--baseline-stream-interval N]] [--profile DIR] [--variant LABEL:NAME=VALUE[;NAME=VALUE...] ...]
        [--calls N] [--threads] [--idle S]

`--calls N`: each stream makes N calls one after another (gRPC and SSE clients), so a run of short streams
(`--tokens 2`: what a request costs apart from its tokens) lasts long enough for /proc's 10 ms CPU clock.
`--threads` prints the frontend's CPU per call by thread ("main" is the event loop; the tokenizer pool's and
grpc's aio poller are Python threads under the process's name, grpc's C threads are "event_engine").

`--stream-interval N` starts this tree's frontend with `--stream-interval N` (vLLM's: chunks of at least N
tokens, frontend_svc/output_processor.py); several values start one frontend per value, alternated on the
same engine and clients, and print each one / the first per round (with `--baseline`: / the baseline,
which runs with its defaults, or `--baseline-stream-interval N`).

`--baseline DIR` (a checkout of another revision, e.g. `git worktree add --detach /tmp/base main`) starts
a second frontend that imports the frontend's code from DIR, on the same fake engine and clients, and
alternates the two on every API and case; it prints this tree / baseline per round (ratios measured side
by side are what this noisy machine can compare).

`--variant "LABEL:NAME=VALUE;..."` (repeatable) starts one more frontend of this tree per variant, alternated
with the others: a NAME starting with `grpc.` is a channel argument of the frontend's public gRPC server,
placed before the frontend's own so that it overrides them (grpc keeps the first of a name; an integer
VALUE is passed as an int; bench/grpc_options_shim), any other NAME an environment
variable of the frontend process (e.g. GRPC_POLL_STRATEGY=poll, GRPC_EXPERIMENTS=...). Ratios are to the
first frontend ("this tree", its defaults).

`--pin` gives the frontend a core of its own (CPU 1, with `taskset`; its threads included) and puts the fake
engine, the clients and this process on CPU 0, as one frontend core per pod would run: unpinned, the frontend
shares both cores with the clients (whose CPU per token is of the frontend's order), so how far it falls
behind at capacity, and how much it merges, depends on how the scheduler shares them.

`--idle S` first measures each frontend's CPU over S seconds with no stream running (ms per second, by thread):
its timers and pollers, which a kept-up stream pays per token as (ms per s) / (tokens per s).

`--syscalls` counts the frontend's system calls (all its threads) with `perf stat` tracepoints during each
measurement and prints them per response message (gRPC) or SSE event: sendmsg = wire writes,
write = mostly grpc's eventfd wake-ups of the event loop, epoll_wait = poller wake-ups. perf adds little
cost, but do not mix its figures with an unprofiled run's.

`--profile DIR` (`pip install py-spy` first, or PY_SPY=/path/to/py-spy) runs `py-spy record` on the frontend during each measurement and writes its samples per
API and case there (collapsed stacks: `flamegraph.pl` or speedscope draw them; PYSPY_NATIVE=1 adds native
frames; PYSPY_RATE sets the samples per second, default 200). py-spy's sampling costs the frontend CPU: do not
report the numbers of a profiled run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

APIS = ("grpc", "grpc-node", "openai")  # grpc-node: the same Generate streams from @grpc/grpc-js clients
NODE_CLIENT = ROOT / "bench" / "grpc_load_client.js"
OPTIONS_SHIM = ROOT / "bench" / "grpc_options_shim"  # sitecustomize.py: --variant's grpc.* server options
REGIMES = ("capacity", "kept-up")
STEP_MS = {"capacity": 2.0, "kept-up": 40.0}  # the engine's step time per regime (128 streams: 64k / 3.2k tok/s)
CASES = ("plain", "stop", "logprobs", "stop+logprobs")
SYSCALLS = ("sendmsg", "sendto", "write", "writev", "recvmsg", "recvfrom", "read", "epoll_wait", "epoll_pwait",
            "futex", "poll", "ppoll")  # --syscalls: counted per message with perf's syscalls:sys_enter_* tracepoints
STOP_STRINGS = ["\nUser:", "<|im_end|>", "THE END", "###"]  # none occurs in the passage
TOP_LOGPROBS = 5
QUESTION = "Tell me a long story about a lighthouse keeper."
GENERATE = "/tandem.v1.GenerationService/Generate"
START_TIMEOUT_S = 120.0
PASSAGE = (
    "The lighthouse stood at the edge of the world, or so it seemed to Mara on the night she arrived. "
    "Waves broke against the rocks below, and the wind carried salt and the smell of rain. She climbed "
    "the spiral stairs, counting each step: one hundred and twelve. At the top, the great lens turned "
    "slowly, throwing its beam across the water in long, patient sweeps. \"Every ship that passes owes "
    "you a little,\" the old keeper had told her, handing over the keys and a thermos of café au lait. "
    "She smiled at that — a naïve thought, perhaps, but a kind one. Over the following weeks she learned "
    "the rhythm of the place: oil the gears at dawn, log the weather at noon, polish the brass before "
    "dusk. Fishermen waved from their boats; once, a child on a ferry shouted \"Bonjour!\" and she waved "
    "back until the ferry was a speck. In winter the storms came in from the north, and the tower hummed "
    "like a struck bell. Mara wrote letters she never sent, read every book on the single shelf twice, "
    "and began to paint the sea in all its moods: grey, green, silver, and on rare mornings a blue so "
    "clear it hurt to look at. 🌊 When spring returned, a boat brought supplies and a note from the "
    "keeper: he was well, he missed the light, and he hoped she had found what she was looking for. "
    "She folded the note, put it in her pocket, and climbed the stairs again.\n\n"
)


# ---- the fake engine's process -------------------------------------------------------------------------


def serve_engine(port: int, vocab_size: int, max_model_len: int, output_ids: list[int], step_s: float) -> None:
    from tests.fake_engine import FakeEngine, start_fake_engine

    async def main() -> None:
        fake = FakeEngine(vocab_size, max_model_len=max_model_len, step_s=step_s, default_max_tokens=None,
                          output_ids=output_ids, clocked=True, catch_up=True)
        server, _ = await start_fake_engine(fake, port)
        await server.wait_for_termination()

    asyncio.run(main())


# ---- the clients' processes ----------------------------------------------------------------------------


@dataclass
class Job:
    api: str
    streams: int
    payload: bytes  # a serialized GenerateRequest, or an HTTP request
    address: str
    calls: int = 1  # calls each stream makes one after another (gRPC and SSE clients)


@dataclass
class Result:
    tokens: int
    messages: int
    cpu_s: float
    wall_s: float
    error: str | None = None
    stream_s: list[float] = field(default_factory=list)  # each stream's time from its request to its end
    first_s: list[float] = field(default_factory=list)  # to its first response (gRPC; SSE's first event is the role)


def client_loop(jobs: Any, results: Any) -> None:
    """One client process: run each job's streams at once and report what they received (grpc-node
    jobs through a Node process it starts once, whose CPU is counted as the client's)."""
    import grpc

    node: subprocess.Popen[str] | None = None
    while True:
        job = jobs.get()
        if job is None:
            break
        start_cpu, start = time.process_time(), time.perf_counter()
        node_cpu = 0.0
        timing = Result(0, 0, 0.0, 0.0)
        try:
            if job.api == "grpc":
                tokens, messages = asyncio.run(_grpc_streams(grpc, job, timing))
            elif job.api == "grpc-node":
                node = node or subprocess.Popen(["node", str(NODE_CLIENT)], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, text=True)
                tokens, messages, node_cpu = _node_streams(node, job)
            else:
                tokens, messages = asyncio.run(_sse_streams(job, timing))
            error = None
        except Exception as exc:  # reported to the parent, which stops
            tokens = messages = 0
            error = f"{type(exc).__name__}: {exc}"
        cpu = time.process_time() - start_cpu + node_cpu
        results.put(Result(tokens, messages, cpu, time.perf_counter() - start, error, timing.stream_s, timing.first_s))
    if node is not None:
        node.stdin.close()  # type: ignore[union-attr]
        node.wait(timeout=10)


def _node_streams(node: subprocess.Popen[str], job: Job) -> tuple[int, int, float]:
    """(tokens, messages, the Node client's CPU seconds) of one job run by bench/grpc_load_client.js."""
    import base64

    from tandem.v1 import generation_pb2 as pb

    request = {"address": job.address, "streams": job.streams, "payload": base64.b64encode(job.payload).decode()}
    node.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
    node.stdin.flush()  # type: ignore[union-attr]
    answer = json.loads(node.stdout.readline())  # type: ignore[union-attr]
    if "error" in answer:
        raise RuntimeError(answer["error"])
    tokens = sum(pb.GenerateResponse.FromString(base64.b64decode(last)).usage.completion_tokens
                 for last in answer["lasts"])
    return tokens, int(answer["messages"]), float(answer["cpu_s"])


async def _grpc_streams(grpc: Any, job: Job, timing: Result) -> tuple[int, int]:
    from tandem.v1 import generation_pb2 as pb

    async with grpc.aio.insecure_channel(job.address) as channel:
        generate = channel.unary_stream(GENERATE)  # no (de)serializers: bytes in, bytes out

        async def one() -> tuple[int, int]:
            tokens = count = 0
            for _ in range(job.calls):
                last, start, first = b"", time.perf_counter(), True
                async for message in generate(job.payload):
                    if first:
                        timing.first_s.append(time.perf_counter() - start)
                        first = False
                    last, count = message, count + 1
                timing.stream_s.append(time.perf_counter() - start)
                tokens += pb.GenerateResponse.FromString(last).usage.completion_tokens
            return tokens, count

        done = await asyncio.gather(*(one() for _ in range(job.streams)))
    return sum(t for t, _ in done), sum(m for _, m in done)


async def _sse_streams(job: Job, timing: Result) -> tuple[int, int]:
    host, port = job.address.rsplit(":", 1)

    async def one() -> tuple[int, int]:
        tokens = events = 0
        for _ in range(job.calls):
            start = time.perf_counter()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(job.payload)
            parts = []
            while data := await reader.read(1 << 16):
                parts.append(data)
            writer.close()
            timing.stream_s.append(time.perf_counter() - start)
            got = _sse_usage(b"".join(parts))
            tokens, events = tokens + got[0], events + got[1]
        return tokens, events

    done = await asyncio.gather(*(one() for _ in range(job.streams)))
    return sum(t for t, _ in done), sum(m for _, m in done)


def _sse_usage(raw: bytes) -> tuple[int, int]:
    """(completion tokens from the usage chunk, events that carried output) of one raw HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"HTTP error: {raw[:300]!r}")
    events = [e for e in _dechunk(body).split(b"\n\n") if e.startswith(b"data: ")]
    usage = json.loads(events[-2][len(b"data: "):])["usage"]  # the last before [DONE]
    return int(usage["completion_tokens"]), len(events) - 3  # not the role chunk, usage and [DONE]


def _dechunk(body: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2


# ---- the parent ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stat_cpu(path: str) -> tuple[str, float]:
    """(the name in parentheses, user + system CPU seconds) of a /proc .../stat file."""
    with open(path) as f:
        head, _, rest = f.read().rpartition(")")
    fields = rest.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    return _stat_cpu(f"/proc/{pid}/stat")[1]


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread of a process, from /proc, keyed "main" (the process's first
    thread) or "NAME:TID" (Python's threads keep the process's name; grpc's C threads have their own)."""
    totals: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            comm, seconds = _stat_cpu(f"/proc/{pid}/task/{task}/stat")
        except OSError:  # the thread ended meanwhile
            continue
        name = "main" if int(task) == pid else f"{comm}:{task}"
        totals[name] = totals.get(name, 0.0) + seconds
    return totals


def case_params(case: str) -> tuple[list[str], bool]:
    return (STOP_STRINGS if "stop" in case else []), "logprobs" in case


def grpc_payload(case: str, tokens: int) -> bytes:
    from tandem.v1 import generation_pb2 as pb

    stops, logprobs = case_params(case)
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=QUESTION)],
                                              add_generation_prompt=True))
    sp = request.sampling_params
    sp.temperature, sp.max_tokens, sp.ignore_eos = 0.0, tokens, True
    sp.stop.extend(stops)
    if logprobs:
        sp.logprobs = TOP_LOGPROBS
    return request.SerializeToString()


def http_payload(case: str, tokens: int, address: str) -> bytes:
    stops, logprobs = case_params(case)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if stops:
        body["stop"] = stops
    if logprobs:
        body["logprobs"], body["top_logprobs"] = True, TOP_LOGPROBS
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode() + data


@dataclass
class Frontend:
    """One running `tandem-frontend` process and its ports."""

    label: str
    process: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    log: Path


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[Any] = []
        self.frontends: list[Frontend] = []
        self.log_dir = Path(tempfile.mkdtemp(prefix="frontend-capacity-"))

    def start(self) -> None:
        from entrypoints.demo_model import demo_gguf_path
        from frontend_svc.gguf_tokenizer import model_limits, read_metadata
        from frontend_svc.tokenizer import Tokenizer

        gguf = Path(self.args.model) if self.args.model else demo_gguf_path()
        vocab_size = model_limits(read_metadata(gguf))["vocab_size"]
        passage_ids = Tokenizer.from_pretrained(gguf).encode(PASSAGE, add_special_tokens=False)
        ctx = mp.get_context("spawn")
        if self.args.pin:
            os.sched_setaffinity(0, {0})
        engine_port = free_port()
        step_s = self.args.step_ms / 1000
        engine = ctx.Process(target=serve_engine, args=(engine_port, vocab_size, 8192, passage_ids, step_s),
                             daemon=True)
        engine.start()
        self.engine_pid = engine.pid
        self.procs.append(engine)
        trees: list[tuple[str, Path | None, int | None, dict[str, str]]] = [
            (f"interval {n}", None, n, {}) for n in self.args.stream_interval or []] or [("this tree", None, None, {})]
        trees += [(label, None, None, settings) for label, settings in self.args.variant or []]
        if self.args.baseline is not None:
            trees.append(("baseline", self.args.baseline.resolve(), self.args.baseline_stream_interval, {}))
        for label, tree, interval, settings in trees:
            self.frontends.append(self._start_frontend(label, tree, gguf, engine_port, interval, settings))
        self.jobs = [ctx.Queue() for _ in range(self.args.clients)]
        self.results = ctx.Queue()
        for queue in self.jobs:
            client = ctx.Process(target=client_loop, args=(queue, self.results), daemon=True)
            client.start()
            self.procs.append(client)
        for frontend in self.frontends:
            self._wait_serving(frontend)

    def _start_frontend(self, label: str, tree: Path | None, gguf: Path, engine_port: int,
                        stream_interval: int | None, settings: dict[str, str]) -> Frontend:
        """A frontend on the shared fake engine; `tree`: import frontend_svc & co. from that checkout;
        `stream_interval`: its --stream-interval (None: its default); `settings`: --variant's
        (grpc.* server options through OPTIONS_SHIM, the rest environment variables)."""
        grpc_port, http_port = free_port(), free_port()
        frontend_bin = Path(sys.executable).parent / "tandem-frontend"
        argv = [str(frontend_bin) if frontend_bin.exists() else shutil.which("tandem-frontend") or "tandem-frontend",
                "--model", str(gguf), "--engine", f"127.0.0.1:{engine_port}", "--host", "127.0.0.1",
                "--port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(free_port()),
                "--max-concurrent-requests", str(max(512, self.args.streams)), "--log-level", "WARNING"]
        if stream_interval is not None:
            argv += ["--stream-interval", str(stream_interval)]
        env = dict(os.environ)
        if tree is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
        options = [[name, int(value) if value.lstrip("-").isdigit() else value]
                   for name, value in settings.items() if name.startswith("grpc.")]
        env.update({name: value for name, value in settings.items() if not name.startswith("grpc.")})
        if options:
            env["FRONTEND_CAPACITY_GRPC_OPTIONS"] = json.dumps(options)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(OPTIONS_SHIM), env.get("PYTHONPATH")) if p)
        log_path = self.log_dir / f"frontend-{len(self.frontends)}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
        if self.args.pin:
            argv = ["taskset", "-c", "1", *argv]
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        return Frontend(label, process, grpc_port, http_port, log_path)

    def _wait_serving(self, frontend: Frontend) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + START_TIMEOUT_S
        with grpc.insecure_channel(f"127.0.0.1:{frontend.grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if frontend.process.poll() is not None:
                    raise RuntimeError(f"the frontend exited: {frontend.log.read_text()}")
                try:
                    answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError("the frontend did not become ready")

    def measure(self, frontend: Frontend, api: str, case: str, streams: int, tokens: int,
                profile: Path | None = None, calls: int = 1) -> dict[str, float]:
        if api in ("grpc", "grpc-node"):
            address, payload = f"127.0.0.1:{frontend.grpc_port}", grpc_payload(case, tokens)
        else:
            address = f"127.0.0.1:{frontend.http_port}"
            payload = http_payload(case, tokens, address)
        shares = [streams // len(self.jobs) + (i < streams % len(self.jobs)) for i in range(len(self.jobs))]
        pid = frontend.process.pid
        spy = self._spy(profile, pid) if profile is not None else None
        perf = self._perf(pid) if self.args.syscalls else None
        frontend0, engine0 = cpu_seconds(pid), cpu_seconds(self.engine_pid)
        threads0 = thread_cpu_seconds(pid) if self.args.threads else {}
        start = time.perf_counter()
        for queue, share in zip(self.jobs, shares):
            queue.put(Job(api, share, payload, address, calls))
        results = [self.results.get() for _ in self.jobs]
        wall = time.perf_counter() - start
        frontend_s, engine_s = cpu_seconds(pid) - frontend0, cpu_seconds(self.engine_pid) - engine0
        threads = {name: s - threads0.get(name, 0.0) for name, s in thread_cpu_seconds(pid).items()} if self.args.threads else {}
        if spy is not None:
            spy.send_signal(2)
            spy.wait()
        counted = self._perf_counts(perf) if perf is not None else {}
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(f"{api}/{case}: {errors[0]}")
        delivered = sum(r.tokens for r in results)
        if delivered != streams * tokens * calls:
            raise RuntimeError(f"{api}/{case}: {delivered} tokens delivered, expected {streams * tokens * calls}")
        return {"frontend": frontend_s / delivered * 1e6, "client": sum(r.cpu_s for r in results) / delivered * 1e6,
                "engine": engine_s / delivered * 1e6, "tok_per_msg": delivered / sum(r.messages for r in results),
                "tok_s": delivered / wall, "stream_ms": _median_ms([t for r in results for t in r.stream_s]),
                "first_ms": _median_ms([t for r in results for t in r.first_s]),
                **{f"{name}/msg": n / sum(r.messages for r in results) for name, n in counted.items()},
                **{f"{name}/call": s / (streams * calls) * 1e6 for name, s in threads.items() if s > 0}}

    def _perf(self, pid: int) -> tuple[subprocess.Popen[bytes], Path]:
        out = self.log_dir / f"perf-{pid}.csv"
        events = ",".join(f"syscalls:sys_enter_{name}" for name in SYSCALLS)
        perf = subprocess.Popen(["perf", "stat", "-x", ",", "-e", events, "-p", str(pid), "-o", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # attached
        return perf, out

    @staticmethod
    def _perf_counts(perf: tuple[subprocess.Popen[bytes], Path]) -> dict[str, float]:
        process, out = perf
        process.send_signal(2)
        process.wait()
        counts = {}
        for line in out.read_text().splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[2].startswith("syscalls:sys_enter_") and fields[0].isdigit():
                counts[fields[2].removeprefix("syscalls:sys_enter_")] = float(fields[0])
        return counts

    def _spy(self, out: Path, pid: int) -> subprocess.Popen[bytes]:
        mode = ["--native"] if os.environ.get("PYSPY_NATIVE") else ["--nonblocking"]
        spy_bin = os.environ.get("PY_SPY") or str(Path(sys.executable).parent / "py-spy")
        argv = [spy_bin, "record", "-r", os.environ.get("PYSPY_RATE", "200"), *mode, "--format", "raw",
                "-o", str(out), "--pid", str(pid)]
        spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached
        return spy

    def stop(self) -> None:
        for queue in getattr(self, "jobs", []):
            queue.put(None)
        for frontend in self.frontends:
            frontend.process.terminate()
            try:
                frontend.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                frontend.process.kill()
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=1,
                        help="calls each stream makes one after another (gRPC and SSE; per-request cost at few tokens)")
    parser.add_argument("--clients", type=int, default=4, help="client processes sharing the streams")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--apis", nargs="+", choices=APIS, default=["grpc", "openai"],
                        help="grpc-node: gRPC from Node clients (@grpc/grpc-js, `make install`'s node_modules)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--regime", choices=REGIMES, default="capacity",
                        help="capacity: the engine offers more than the frontend takes; kept-up: less")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="the engine's step time (default: 2 for capacity, 40 for kept-up)")
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct's)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of another revision: run its frontend too, alternating with this one")
    parser.add_argument("--baseline-stream-interval", type=int, default=None, metavar="N",
                        help="the baseline frontend's --stream-interval (default: its default)")
    parser.add_argument("--profile", type=Path, default=None, help="write py-spy samples here")
    parser.add_argument("--stream-interval", type=int, nargs="+", default=None,
                        help="this tree's frontend's --stream-interval; several: one frontend per value")
    parser.add_argument("--pin", action="store_true",
                        help="the frontend alone on CPU 1, the engine, clients and this process on CPU 0")
    parser.add_argument("--threads", action="store_true",
                        help="print the frontend's CPU per call by thread name (/proc/PID/task)")
    parser.add_argument("--idle", type=float, default=0.0, metavar="S",
                        help="first measure each frontend's CPU while nothing runs, over S seconds (ms per s)")
    parser.add_argument("--syscalls", action="store_true",
                        help="count the frontend's system calls per message (perf stat tracepoints)")
    parser.add_argument("--variant", type=variant, action="append", default=None,
                        help="LABEL:NAME=VALUE;... one more frontend of this tree with these grpc.* server "
                             "options / environment variables")
    args = parser.parse_args()
    if args.step_ms is None:
        args.step_ms = STEP_MS[args.regime]
    if args.calls > 1 and "grpc-node" in args.apis:
        parser.error("--calls applies to the Python gRPC and SSE clients only")
    bench = Bench(args)
    try:
        bench.start()
        for frontend in bench.frontends:
            for api in args.apis:  # warm-up: connections, caches, the chat template
                bench.measure(frontend, api, "stop+logprobs", min(args.streams, 16), 32)
        if args.idle > 0:
            idle_cpu(bench.frontends, args.idle)
        runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
        print(f"{args.regime} (engine step {args.step_ms:g} ms): {args.streams} streams x {args.calls} calls x {args.tokens} tokens, {args.clients} client processes, "
              f"{os.cpu_count()} CPUs; per round:")
        for r in range(args.rounds):
            forward = r % 2 == 0
            for case in args.cases if forward else reversed(args.cases):
                for api in args.apis if forward else reversed(args.apis):
                    for frontend in bench.frontends if forward else reversed(bench.frontends):
                        profile = None
                        if args.profile is not None:
                            args.profile.mkdir(parents=True, exist_ok=True)
                            suffix = "-baseline" if frontend.label == "baseline" else ""
                            profile = args.profile / f"{api}-{case.replace('+', '-')}{suffix}.txt"
                        m = bench.measure(frontend, api, case, args.streams, args.tokens, profile, args.calls)
                        runs.setdefault((frontend.label, api, case), []).append(m)
                        print(f"  round {r + 1} {frontend.label:11} {api:9} {case:14} frontend "
                              f"{m['frontend']:6.1f} us/tok  client {m['client']:5.1f}  engine {m['engine']:5.1f}  "
                              f"tok/msg {m['tok_per_msg']:.2f}  {m['tok_s']:7.0f} tok/s  stream {m['stream_ms']:6.0f} ms"
                              f"  first {m['first_ms']:5.1f} ms", flush=True)
                        if args.threads:
                            per_thread = sorted(((v, k[:-5]) for k, v in m.items() if k.endswith("/call")), reverse=True)
                            print("    us per call by thread: " + "  ".join(f"{k} {v:.0f}" for v, k in per_thread),
                                  flush=True)
                        if args.syscalls:
                            print("    syscalls per message: " + "  ".join(
                                f"{k[:-4]} {v:.2f}" for k, v in m.items() if k.endswith("/msg") and v), flush=True)
        report(runs, args)
    finally:
        bench.stop()


def idle_cpu(frontends: list[Frontend], seconds: float) -> None:
    """Print each frontend's CPU (ms per second, by thread) while no stream runs: the cost of its timers and
    pollers, which a kept-up stream pays per token as (ms per s) / (tokens per s)."""
    before = {f.label: thread_cpu_seconds(f.process.pid) for f in frontends}
    time.sleep(seconds)
    for f in frontends:
        after = thread_cpu_seconds(f.process.pid)
        per_thread = {k: 1e3 * (v - before[f.label].get(k, 0.0)) / seconds for k, v in after.items()}
        busy = "  ".join(f"{k} {v:.1f}" for k, v in sorted(per_thread.items(), key=lambda kv: -kv[1]) if v > 0)
        print(f"idle {f.label:11} frontend {sum(per_thread.values()):6.1f} ms of CPU per s   ({busy})", flush=True)


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3 if seconds else float("nan")


def variant(spec: str) -> tuple[str, dict[str, str]]:
    """--variant's LABEL:NAME=VALUE;NAME=VALUE -> (LABEL, {NAME: VALUE}) (a VALUE may hold commas)."""
    label, _, pairs = spec.partition(":")
    settings = dict(pair.split("=", 1) for pair in pairs.split(";") if pair)
    if not label or not settings:
        raise argparse.ArgumentTypeError(f"expected LABEL:NAME=VALUE[;NAME=VALUE...], got {spec!r}")
    return label[:11], settings


def report(runs: dict[tuple[str, str, str], list[dict[str, float]]], args: argparse.Namespace) -> None:
    """Medians over rounds; with a baseline, this tree / baseline per API and case."""
    print("\nmedian over rounds (us of CPU per delivered token):")
    print(f"  {'frontend':11} {'api':9} {'case':14} {'frontend':>9} {'client':>7} {'engine':>7} {'tok/msg':>8} "
          f"{'tok/s':>7} {'stream ms':>9} {'first ms':>8}")
    for key, ms in sorted(runs.items(), key=lambda kv: (APIS.index(kv[0][1]), CASES.index(kv[0][2]), kv[0][0])):
        med = {k: statistics.median(m.get(k, 0.0) for m in ms) for k in ms[0]}
        print(f"  {key[0]:11} {key[1]:9} {key[2]:14} {med['frontend']:9.1f} {med['client']:7.1f} "
              f"{med['engine']:7.1f} {med['tok_per_msg']:8.2f} {med['tok_s']:7.0f} {med['stream_ms']:9.0f} "
              f"{med['first_ms']:8.1f}")
    labels = list(dict.fromkeys(key[0] for key in runs))
    reference = "baseline" if "baseline" in labels else labels[0]
    for label in labels:
        if label == reference:
            continue
        print(f"\n{label} / {reference}, frontend us/tok (median of the per-round ratios):")
        for api in args.apis:
            for case in args.cases:
                ratios = [a["frontend"] / b["frontend"]
                          for a, b in zip(runs[(label, api, case)], runs[(reference, api, case)])]
                print(f"  {api:9} {case:14} {statistics.median(ratios):.2f}  "
                      f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
