"""The hostile-input probe of issue 22, as a benchmark: what each attack costs the other clients of one
`tandem-engine` + `tandem-frontend` pair (a real model, `--model DIR`), measured from outside.

A victim stream (gRPC Generate, greedy, ignore_eos) runs through every attack; its longest gap between
responses during the attack is the stall the attack caused. Attacks (`--attacks`, default all):

- `keepalive`: two `GET /health` on one HTTP keep-alive connection, the pair timed (median of 20), beside
  the same two on two fresh connections (without TCP_NODELAY the keep-alive pair waited ~40 ms more).
- `header`: one HTTP request whose header is `--header-mb` MB, sent while reading the answer; reports
  the status, the frontend's RSS growth and the victim's gap.
- `idle`: `--idle` idle HTTP connections held open; then the time `/health` (new connection) and a gRPC
  GetModelInfo take, and how many of the idle connections the server still holds after
  `--idle-wait` seconds.
- `engine-add`: a `--add-mb` MB `EngineCoreService/Connect` add sent straight to the engine (with the
  engine token when `--engine-token-file` is given); reports the status, the engine's RSS growth and
  the victim's gap.
- `prefill`: a `--prompt-tokens`-token prompt (random ids) sent beside the victim; reports the gap.

    python bench/edge.py --model .tiny-models/SmolLM2-135M-Instruct [--attacks keepalive header ...]
        [--engine-args "--max-num-batched-tokens 8192 --long-prefill-token-threshold 0"]

Run it under `/work/bin/quiet` on a shared box: the gaps are wall-clock times on this machine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import grpc  # noqa: E402
from serve import free_port, wait_http_ready, wait_serving  # noqa: E402
from tandem.engine.v1 import engine_core_pb2 as epb  # noqa: E402
from tandem.v1 import generation_pb2 as pb  # noqa: E402
from tandem.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

ATTACKS = ("keepalive", "header", "idle", "engine-add", "prefill")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Pair:
    """An engine and a frontend (with the HTTP API) as child processes."""

    def __init__(self, model: str, engine_args: list[str], log_dir: Path) -> None:
        import subprocess

        self.engine_port, self.port, self.http_port = free_port(), free_port(), free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}

        def start(argv: list[str], log: str) -> Any:
            with (log_dir / log).open("ab") as out:
                return subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env, stdout=out,
                                        stderr=subprocess.STDOUT)

        self.engine = start(["engine_svc.cli", "--model", model, "--port", str(self.engine_port),
                             "--metrics-port", "0", "--dtype", "float32", "--log-level", "WARNING",
                             *engine_args], "engine.log")
        self.frontend = start(["frontend_svc.cli", "--model", model, "--engine", f"127.0.0.1:{self.engine_port}",
                               "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", "0",
                               "--http-port", str(self.http_port), "--log-level", "WARNING"], "frontend.log")
        wait_serving(self.engine_port, self.engine)
        wait_serving(self.port, self.frontend)
        wait_http_ready(self.http_port, self.frontend)

    def stop(self) -> None:
        for proc in (self.frontend, self.engine):
            proc.terminate()
            try:
                proc.wait(30)
            except Exception:
                proc.kill()


class Victim:
    """A long greedy stream through the frontend; `gap(start, end)` is its longest silence in [start, end].

    The stream is read in a process of its own (this script's `--victim PORT`), which stamps each
    response with the system-wide monotonic clock as it arrives: the attack's client threads in this
    process (building multi-MB bodies, 100 concurrent calls) share this process's GIL, and must not
    delay the victim's reader, or the gap would measure the bench rather than the server.
    """

    def __init__(self, port: int) -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, __file__, "--victim", str(port)], stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.arrivals: list[float] = []
        threading.Thread(target=self._read, daemon=True).start()
        while len(self.arrivals) < 21:  # a pace to compare the attacks' gaps with
            if self.proc.poll() is not None:
                raise RuntimeError("the victim stream ended before it started")
            time.sleep(0.01)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.arrivals.append(float(line))

    @staticmethod
    def stream(port: int) -> None:
        """The victim process: stream and print each response's arrival time."""
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 504, 3458, 282]),
                                     sampling_params=pb.SamplingParams(temperature=0, max_tokens=4000,
                                                                       ignore_eos=True))
        try:
            for _ in pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=900):
                print(time.monotonic(), flush=True)
        except (grpc.RpcError, BrokenPipeError):
            pass

    def gap(self, start: float, end: float) -> float:
        times = [start, *(t for t in self.arrivals if start < t < end), end]
        return max(b - a for a, b in itertools.pairwise(times))

    def median_gap_before(self, start: float, count: int = 20) -> float:
        """The median of the victim's last `count` gaps before `start` (its pace without the attack)."""
        times = [t for t in self.arrivals if t < start][-count - 1:]
        return statistics.median(b - a for a, b in itertools.pairwise(times))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def http_get(sock: socket.socket) -> None:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk


def http_get_twice(port: int, keep_alive: bool) -> float:
    """Two `GET /health`: on one keep-alive connection, or each on a connection of its own (connects timed)."""
    t0 = time.perf_counter()
    if keep_alive:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            http_get(sock)
            http_get(sock)
    else:
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                http_get(sock)
    return time.perf_counter() - t0


def attack_keepalive(pair: Pair, args: argparse.Namespace) -> None:
    """Nagle's delay shows as the keep-alive pair costing ~40 ms more than two fresh connections."""
    http_get_twice(pair.http_port, True)
    kept, fresh = [], []
    for _ in range(20):
        kept.append(http_get_twice(pair.http_port, True))
        fresh.append(http_get_twice(pair.http_port, False))
    k, f = statistics.median(kept), statistics.median(fresh)
    print(f"keepalive: two GET /health on one connection: median {1000 * k:.1f} ms (max {1000 * max(kept):.1f}); "
          f"on two fresh connections: median {1000 * f:.1f} ms; ratio {k / f:.2f}")


def send_big_header(port: int, megabytes: int) -> bytes:
    """Send a request with a huge header on one thread while reading the answer on this one."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(120)

    def send() -> None:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            block = b"a" * (1 << 20)
            for _ in range(megabytes):
                sock.sendall(block)
            sock.sendall(b"\r\n\r\n")
        except OSError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        answer = sock.recv(4096)
    except OSError as exc:
        answer = repr(exc).encode()
    sender.join(120)
    sock.close()
    return answer


def attack_header(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    before = rss_bytes(pair.frontend.pid)
    peak = [before]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes(pair.frontend.pid))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.monotonic()
    answer = send_big_header(pair.http_port, args.header_mb)
    end = time.monotonic()
    stop.set()
    watcher.join()
    status = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    print(f"header: {args.header_mb} MB header -> {status!r} in {end - start:.2f} s; frontend RSS "
          f"+{(peak[0] - before) / 2**20:.0f} MiB (peak); victim gap {1000 * victim.gap(start, end):.0f} ms (its median before: "
          f"{1000 * victim.median_gap_before(start):.0f} ms)")


def attack_idle(pair: Pair, args: argparse.Namespace) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 256)), hard))
    idle = []
    for _ in range(args.idle):
        try:
            idle.append(socket.create_connection(("127.0.0.1", pair.http_port), timeout=5))
        except OSError as exc:
            print(f"idle: connection {len(idle)} failed: {exc}")
            break
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", pair.http_port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status = sock.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    except OSError as exc:
        status = repr(exc)
    health_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with grpc.insecure_channel(f"127.0.0.1:{pair.port}") as channel:
        try:
            pb_grpc.GenerationServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            grpc_status = "OK"
        except grpc.RpcError as exc:
            grpc_status = exc.code().name
    grpc_s = time.perf_counter() - t0
    time.sleep(args.idle_wait)
    open_count = 0
    for sock in idle:
        sock.setblocking(False)
        try:
            sock.recv(1)  # b"": the server closed it
        except BlockingIOError:
            open_count += 1  # nothing to read and not closed: still open
        except OSError:
            pass
        sock.close()
    print(f"idle: {len(idle)} idle connections; /health -> {status!r} in {1000 * health_s:.0f} ms, gRPC "
          f"GetModelInfo {grpc_status} in {1000 * grpc_s:.0f} ms; {open_count} still open after "
          f"{args.idle_wait:.0f} s")


def attack_engine_add(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    ids = [random.randrange(100, 40000) for _ in range(args.add_mb * 1024 * 1024 // 3)]
    message = epb.EngineCoreInput(add=epb.EngineCoreRequest(request_id="big", prompt_token_ids=ids,
                                                            sampling_params=epb.EngineSamplingParams()))
    size = message.ByteSize()
    metadata = []
    if args.engine_token_file:
        metadata.append(("authorization", "Bearer " + Path(args.engine_token_file).read_text().split()[0]))
    before = rss_bytes(pair.engine.pid)
    peak = [before]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes(pair.engine.pid))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    start = time.monotonic()
    with grpc.insecure_channel(f"127.0.0.1:{pair.engine_port}", options=options) as channel:
        connect = channel.stream_stream("/tandem.engine.v1.EngineCoreService/Connect",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=epb.EngineCoreOutputs.FromString)
        call = connect(iter([message]), timeout=60, metadata=metadata)
        try:
            first = next(call)  # the add's answer (an error output), or the stream's end
            status = "answered: " + "; ".join(f"{x.error.message[:80]}" for x in first.outputs)
            call.cancel()
        except grpc.RpcError as exc:
            status = f"{exc.code().name}: {exc.details()[:100]}"
    end = time.monotonic()
    time.sleep(0.5)
    stop.set()
    watcher.join()
    print(f"engine-add: {size / 1e6:.0f} MB add -> {status} in {end - start:.2f} s; engine RSS "
          f"+{(peak[0] - before) / 2**20:.0f} MiB (peak); victim gap {1000 * victim.gap(start, end):.0f} ms (its median before: "
          f"{1000 * victim.median_gap_before(start):.0f} ms)")


def attack_prefill(pair: Pair, args: argparse.Namespace, victim: Victim) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
    with grpc.insecure_channel(f"127.0.0.1:{pair.port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        start = time.monotonic()
        list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                              sampling_params=pb.SamplingParams(temperature=0, max_tokens=1)),
                           timeout=900))
        end = time.monotonic()
    print(f"prefill: a {args.prompt_tokens}-token prompt took {end - start:.2f} s (TTFT); victim gap "
          f"{1000 * victim.gap(start, end):.0f} ms; victim's median gap before it "
          f"{1000 * victim.median_gap_before(start):.0f} ms")


def main() -> int:
    if sys.argv[1:2] == ["--victim"]:
        Victim.stream(int(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    ap.add_argument("--engine-args", default="", help="extra engine flags, one string")
    ap.add_argument("--engine-token-file", default=None)
    ap.add_argument("--header-mb", type=int, default=200)
    ap.add_argument("--idle", type=int, default=2000)
    ap.add_argument("--idle-wait", type=float, default=10.0)
    ap.add_argument("--add-mb", type=int, default=60)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    args = ap.parse_args()
    engine_args = shlex.split(args.engine_args)
    if args.engine_token_file:
        engine_args += ["--engine-token-file", args.engine_token_file]
    with tempfile.TemporaryDirectory() as logs:
        pair = Pair(args.model, engine_args, Path(logs))
        try:
            victim = Victim(pair.port)
            try:
                for name in args.attacks:
                    if name == "keepalive":
                        attack_keepalive(pair, args)
                    elif name == "idle":
                        attack_idle(pair, args)
                    else:
                        globals()[f"attack_{name.replace('-', '_')}"](pair, args, victim)
            finally:
                victim.close()
        finally:
            pair.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
