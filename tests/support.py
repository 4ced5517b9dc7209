"""Helpers every test package shares. Import them from here rather than writing another:

- `wait_until(predicate, timeout, what)`: poll until the predicate holds, or fail naming what never came.
- `free_port(span=1)` (below the ephemeral range, never the same twice), `health_status(address, service)`, `is_serving(address)`.
- `max_gap(arrivals, start, end)`: the longest silence of a stream within [start, end] (stall tests).
- `rpc_error(call)`: the grpc.RpcError a call raises (fails the test if it raises none);
  `bad_fields(error)`: the field paths of its `google.rpc.BadRequest` details.
- `LoopThread`: an asyncio loop on a daemon thread, for servers run in the test process.
- `DeadlineClient`: a `TandemClient` whose every call has a deadline, so a test fails instead of hanging
  when a server stops answering (`RPC_TIMEOUT_S` unless the call passes its own `timeout=`).
- `Service`: one tandem service process (`python -m ...`) on a loopback port, its output in a log file.

Nothing here imports torch or engine_svc: the frontend-only tests use it too.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from tandem.v1 import generation_pb2 as pb

from frontend_svc.client import ChatMessages, TandemClient

ROOT = Path(__file__).resolve().parents[1]
# The longest a victim stream may go without a response while another client's hostile request is
# handled. Each attack stalled it for 1.2 s to 9.6 s before its fix; its normal gap is a few ms, and up
# to ~0.35 s when the 2-core machine is shared with the attack's own legitimate work and other processes.
MAX_STALL_S = 0.6
RPC_TIMEOUT_S = 60.0  # the deadline of every test RPC that does not set a shorter one
SERVING = health_pb2.HealthCheckResponse.SERVING


def wait_until(predicate: Callable[[], object], timeout: float = 15.0, what: str = "condition", *,
               interval: float = 0.02, retry_on: tuple[type[BaseException], ...] = ()) -> None:
    """Poll `predicate` every `interval` seconds until it is true; AssertionError after `timeout`.

    Exceptions of the types in `retry_on` count as "not yet" (e.g. grpc.RpcError while a server starts);
    any other exception propagates at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except retry_on:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(interval)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take their local port from it)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORT_FLOOR = 15000
_ports_given: set[int] = set()
_port_lock = threading.Lock()
# A per-process start (pids differ between two suites run side by side); never pytest-randomly's seeded `random`.
_port_cursor = itertools.count(os.getpid() * 211 % max(1, _ephemeral_low() - _PORT_FLOOR - 64))


def free_port(span: int = 1) -> int:
    """The first of `span` consecutive loopback ports that are free now, below the ephemeral range and never
    handed out before in this process.

    A port the OS picks for `bind(0)` is an ephemeral one: between our close and the server's bind, any
    outgoing connection (a frontend dialling an engine, another test's client) may take it as its local
    port, and the server then fails with "address in use". Ports below the range are never given to
    outgoing connections; the set keeps two servers of one test from getting the same port."""
    high = _ephemeral_low() - span
    with _port_lock:
        for _ in range(high - _PORT_FLOOR):
            first = _PORT_FLOOR + next(_port_cursor) % (high - _PORT_FLOOR)
            ports = range(first, first + span)
            if any(p in _ports_given for p in ports) or not all(_bindable(p) for p in ports):
                continue
            _ports_given.update(ports)
            return first
    raise RuntimeError(f"no {span} free loopback port(s) in [{_PORT_FLOOR}, {high})")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def health_status(address: str, service: str = "", timeout: float = 2.0) -> int:
    """The grpc.health.v1 status of `service` at `address` (plaintext); -1 when the call fails."""
    with grpc.insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout).status)
        except grpc.RpcError:
            return -1


def is_serving(address: str, service: str = "") -> bool:
    return health_status(address, service) == SERVING


def max_gap(arrivals: Sequence[float], start: float, end: float) -> float:
    """The longest time without an arrival within [start, end] (the edges count as arrivals)."""
    times = [start, *(t for t in arrivals if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(times))


def metric_value(port: int, name: str) -> float:
    """The value of the first sample of `name` on a service's Prometheus endpoint (127.0.0.1:`port`)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return float(next(x for x in text.splitlines() if x.startswith(name)).split()[-1])


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def bad_fields(error: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(error)
    assert status is not None, f"no google.rpc.Status details on {error.code()}: {error.details()}"
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields.extend(v.field for v in bad.field_violations)
    return fields


class LoopThread:
    """An asyncio loop on a daemon thread; `run(coro)` runs a coroutine there and returns its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-event-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run a plain function on the loop's thread (e.g. to build an object bound to that loop)."""
        async def wrapper() -> Any:
            return fn()
        return self.run(wrapper())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class DeadlineClient(TandemClient):
    """`TandemClient` with a deadline on every call (`RPC_TIMEOUT_S` unless `timeout=` says otherwise)."""

    def generate(self, prompt: str | None = None, *, timeout: float | None = RPC_TIMEOUT_S,
                 **kwargs: Any) -> Iterator[pb.GenerateResponse]:
        return super().generate(prompt, timeout=timeout, **kwargs)

    def tokenize(self, text: str | None = None, *, chat: ChatMessages | None = None,
                 add_special_tokens: bool | None = None, timeout: float | None = RPC_TIMEOUT_S) -> list[int]:
        return super().tokenize(text, chat=chat, add_special_tokens=add_special_tokens, timeout=timeout)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                   timeout: float | None = RPC_TIMEOUT_S) -> str:
        return super().detokenize(token_ids, skip_special_tokens=skip_special_tokens, timeout=timeout)

    def model_info(self, timeout: float | None = RPC_TIMEOUT_S) -> pb.GetModelInfoResponse:
        return super().model_info(timeout=timeout)


class Service:
    """One child process serving gRPC on 127.0.0.1:`port`; its output goes to `log_dir`/`name`-`port`.log."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.log_path = log_dir / f"{name}-{port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Service:
        # The protos beside the code: a worktree's, not those of the checkout the venv was installed from.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos")]),
               "TOKENIZERS_PARALLELISM": "false"}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_serving(self, timeout: float = 120.0, health_address: str | None = None) -> Service:
        """Until health ("" at `health_address`, default the service's own) is SERVING; fails at once
        if the process exits meanwhile."""
        address = health_address or self.address

        def up() -> bool:
            assert self.running(), f"{self.name} exited:\n{self.log()}"
            return health_status(address, timeout=1.0) == SERVING

        try:
            wait_until(up, timeout, f"{self.name} SERVING", interval=0.1)
        except AssertionError as exc:
            if self.running():  # timed out (an exit says so itself, with the log)
                raise AssertionError(f"{exc}:\n{self.log()}") from None
            raise
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def stop(self) -> int | None:
        """SIGTERM (drain), then SIGKILL if it lingers; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes `sock` within `timeout` (reading and dropping whatever it sends)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def slowloris_until_closed(sock: socket.socket, give_up_s: float) -> float | None:
    """Send one more header byte every 0.3 s until the server closes `sock`: the seconds that took, or
    None if it was still open after `give_up_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < give_up_s:
        try:
            sock.sendall(b"X")
        except OSError:
            return time.monotonic() - t0
        if closed_by_server(sock, 0.3):
            return time.monotonic() - t0
    return None
