"""The HTTP edge (frontend_svc/openai/edge.py, issue 22): what reaches the API port below the body.

An in-process stack (fake engine + real `FrontendServer` with its HTTP port) on real sockets; raw sockets
play the attacker, a gRPC stream plays the victim. Before the fix a 200 MB header was parsed for 58 s
(answered 200, +400 MB, the event loop blocked 0.4-0.8 s per read); idle and half-sent connections were
held forever; every keep-alive response waited ~40 ms for Nagle's algorithm.
"""

from __future__ import annotations

import logging
import resource
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from frontend_svc.client import TandemClient
from shared_runtime.security.http_limits import HttpLimits
from shared_runtime.security.tls import TlsFiles
from tests.openai_api.conftest import HttpStack
from tests.security.certs import CertificateAuthority
from tests.security.secure_stack import Victim
from tests.support import MAX_STALL_S, LoopThread, closed_by_server, slowloris_until_closed, wait_until

NUM_IDLE = 2000
SHORT = HttpLimits(keep_alive_timeout_s=1.0, header_timeout_s=1.5, body_timeout_s=1.5)


@pytest.fixture(scope="module", autouse=True)
def enough_descriptors() -> None:
    """Both ends of every test connection live in this process: 2 x NUM_IDLE descriptors and more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * NUM_IDLE + 1024
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.fail(f"these tests need `ulimit -n` >= {wanted} (the hard limit is {hard})")
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    """Default limits except short timeouts (so the timeout tests stay fast)."""
    s = HttpStack(loop, tokenizer, tiny_model_dir, http_limits=SHORT, step_s=0.01)
    s.wait_http_ready()
    s.wait_serving()
    yield s
    s.close()


def connect(stack: HttpStack) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", stack.frontend.http.bound_port), timeout=10)
    return sock


def read_response(sock: socket.socket) -> bytes:
    """One whole response (headers + Content-Length body) from `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else -1


def peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


# ---- header size and count ----------------------------------------------------------------------------------

def test_a_200_mb_header_is_431_without_memory_or_a_stall(stack: HttpStack) -> None:
    """Sent on one thread while the answer is read on this one, as a real client does."""
    sock = connect(stack)
    block = b"a" * (1 << 20)

    def send() -> None:
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for _ in range(200):
                sock.sendall(block)
        except OSError:
            pass  # the server has answered and closed

    with TandemClient(stack.address) as client:
        victim = Victim(client.generate(token_ids=[5, 6, 7], timeout=60))
        try:
            victim.wait_started()
            peak_rss_reset()
            before = peak_rss()
            start = time.monotonic()
            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            response = read_response(sock)
            sender.join(30)
            end = time.monotonic()
            grown = peak_rss() - before
            time.sleep(0.05)
            assert victim.error is None, victim.error
            gap = victim.max_gap(start, end)
        finally:
            victim.stop()
            sock.close()
    assert status_of(response) == 431, response[:200]
    assert grown < 20 * 2**20, f"peak RSS grew {grown / 2**20:.0f} MiB"
    assert gap < MAX_STALL_S, f"victim stalled {gap * 1000:.0f} ms"


def test_too_many_header_fields_is_431(stack: HttpStack) -> None:
    limit = SHORT.max_header_count
    for count, expected in ((limit - 2, 200), (limit + 1, 431)):
        with connect(stack) as sock:
            fields = b"".join(b"X-F%d: v\r\n" % i for i in range(count))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
            assert status_of(read_response(sock)) == expected


def test_a_header_at_the_byte_limit_is_served_one_past_it_is_431(stack: HttpStack) -> None:
    start = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: "
    room = SHORT.max_header_bytes - len(start) - 4
    for pad, expected in ((room - 64, 200), (SHORT.max_header_bytes, 431)):
        with connect(stack) as sock:
            sock.sendall(start + b"p" * pad + b"\r\n\r\n")
            assert status_of(read_response(sock)) == expected


# ---- timeouts -------------------------------------------------------------------------------------------------

def test_a_fresh_idle_connection_is_closed_after_the_keep_alive_timeout(stack: HttpStack) -> None:
    with connect(stack) as sock:
        t0 = time.monotonic()
        assert closed_by_server(sock, 5.0)
        assert SHORT.keep_alive_timeout_s - 0.1 <= time.monotonic() - t0 < SHORT.keep_alive_timeout_s + 1.5


def test_a_slowloris_header_is_cut_at_the_header_timeout(stack: HttpStack) -> None:
    """One header byte every 0.3 s keeps resetting no idle timer: the header-read deadline closes it."""
    with connect(stack) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        elapsed = slowloris_until_closed(sock, SHORT.header_timeout_s + 3)
    assert elapsed is not None and SHORT.header_timeout_s - 0.1 <= elapsed < SHORT.header_timeout_s + 1.5, elapsed


def test_a_body_shorter_than_its_content_length_gets_408(stack: HttpStack) -> None:
    with connect(stack) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        response = read_response(sock)
        elapsed = time.monotonic() - t0
    assert status_of(response) == 408, response[:200]
    assert SHORT.body_timeout_s - 0.1 <= elapsed < SHORT.body_timeout_s + 1.5
    wait_until(lambda: stack.frontend.admission.in_use == 0, 5, "admission released")


def test_a_long_stream_outlives_every_timeout(stack: HttpStack) -> None:
    """The timeouts bound what the client sends, never how long a response may stream."""
    url = f"{stack.url}/v1/completions"
    with httpx2.stream("POST", url, json={"prompt": [5, 6, 7], "max_tokens": 250, "stream": True},
                       timeout=30) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 200  # 250 tokens x 10 ms > every timeout


# ---- connections ----------------------------------------------------------------------------------------------

def test_2000_idle_connections_leave_health_and_grpc_answering(loop: LoopThread, tokenizer: Any,
                                                              tiny_model_dir: Path) -> None:
    """Before: 20,000 idle connections exhausted the descriptors; /health and gRPC calls timed out.
    Now all 2,000 are held (below the default cap of 2,048), the API answers, and each idle connection is
    closed once the keep-alive timeout has passed."""
    keep_alive = 4.0
    s = HttpStack(loop, tokenizer, tiny_model_dir, http_limits=HttpLimits(keep_alive_timeout_s=keep_alive))
    idle: list[tuple[float, socket.socket]] = []
    try:
        s.wait_http_ready()
        opened = time.monotonic()
        guard = s.frontend.http.guard
        for batch in range(0, NUM_IDLE, 100):  # paced so the kernel's accept queue (the backlog) never overflows
            idle += [(time.monotonic(), connect(s)) for _ in range(100)]
            wait_until(lambda n=batch + 100: guard.open >= n, 5, "the batch accepted", interval=0.002)
        assert time.monotonic() - opened < keep_alive - 1, "opening the connections took too long to test"
        t0 = time.monotonic()
        with connect(s) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(read_response(sock)) == 200
        health_s = time.monotonic() - t0
        t0 = time.monotonic()
        with TandemClient(s.address) as client:
            assert client.model_info(timeout=5).max_model_len > 0
        grpc_s = time.monotonic() - t0
        assert health_s < 1.0 and grpc_s < 1.0, (health_s, grpc_s)
        assert guard.open >= NUM_IDLE  # every idle connection is still held
        for started, sock in idle:
            assert closed_by_server(sock, max(0.01, started + keep_alive + 3 - time.monotonic()))
            assert time.monotonic() - started >= keep_alive - 0.1
        wait_until(lambda: s.frontend.http.guard.open == 0, 5, "every connection released")
    finally:
        for _, sock in idle:
            sock.close()
        s.close()


def test_the_connection_cap_closes_idle_ones_first_then_refuses(loop: LoopThread, tokenizer: Any,
                                                               tiny_model_dir: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    cap = 20
    s = HttpStack(loop, tokenizer, tiny_model_dir, http_limits=HttpLimits(max_connections=cap))
    socks: list[socket.socket] = []
    try:
        s.wait_http_ready()
        guard = s.frontend.http.guard
        wait_until(lambda: guard.open == 0, 5, "the readiness probe's connection closed")
        socks = [connect(s) for _ in range(cap)]
        wait_until(lambda: guard.open == cap, 5, "all connections admitted")
        newcomers = [connect(s) for _ in range(5)]  # each closes the longest-idle one
        assert all(closed_by_server(old, 2.0) for old in socks[:5])
        socks = socks[5:] + newcomers
        for sock in socks:  # now all busy: a header whose body never comes
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        wait_until(lambda: not guard._idle, 5, "every connection busy")
        with caplog.at_level(logging.WARNING, logger="shared_runtime.security.http_limits"):
            refused = []
            for _ in range(30):
                with connect(s) as extra:
                    refused.append(status_of(read_response(extra)))
        assert refused == [503] * 30
        assert guard.open == cap and guard.refused == 30
        reports = [r for r in caplog.records if r.name == "shared_runtime.security.http_limits"]
        assert len(reports) <= 1  # rate-limited: one line per 10 s, not one per connection
    finally:
        for sock in socks:
            sock.close()
        s.close()


def test_two_keep_alive_requests_take_under_10_ms(stack: HttpStack) -> None:
    """TCP_NODELAY on the accepted socket: without it the second response waited ~40 ms (Nagle)."""
    with connect(stack) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        read_response(sock)  # warm
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            for _ in range(2):
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert status_of(read_response(sock)) == 200
            times.append(time.perf_counter() - t0)
    times.sort()
    assert times[len(times) // 2] < 0.010, f"median pair {times[len(times) // 2] * 1000:.1f} ms"


# ---- TLS --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpStack, CertificateAuthority]]:
    root = tmp_path_factory.mktemp("http-edge-tls")
    ca = CertificateAuthority(root, "edge-ca")
    issued = ca.issue("first-frontend")
    s = HttpStack(loop, tokenizer, tiny_model_dir, http_limits=SHORT,
                  tls=TlsFiles(str(issued.certfile), str(issued.keyfile)))
    yield s, ca
    s.close()


def tls_context(ca: CertificateAuthority) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca.certfile))


def test_https_keep_alive_and_certificate_rotation(tls_stack: tuple[HttpStack, CertificateAuthority]) -> None:
    stack, ca = tls_stack
    port = stack.frontend.http.bound_port
    context = tls_context(ca)

    def served_name() -> str:
        """The certificate's name, once /health says 200 over it."""
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5),
                                 server_hostname="localhost") as tls:
            cert = tls.getpeercert()
            tls.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            if status_of(read_response(tls)) != 200:
                return "not ready"
            return dict(x[0] for x in cert["subject"])["commonName"]  # type: ignore[index]

    wait_until(lambda: served_name() == "first-frontend", 15, "HTTPS up", retry_on=(OSError,))
    with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5),
                             server_hostname="localhost") as tls:
        tls.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        read_response(tls)
        t0 = time.perf_counter()
        for _ in range(2):
            tls.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(read_response(tls)) == 200
        # Two requests on one kept-alive TLS connection: ~1 ms with TCP_NODELAY; without it each small
        # response write waits for the client's delayed ACK (~40 ms). 40 ms for both leaves room for a busy box.
        assert time.perf_counter() - t0 < 0.040
    rotated = ca.issue("second-frontend")
    files = stack.frontend.http.tls.files
    Path(files.certfile).write_bytes(Path(rotated.certfile).read_bytes())
    Path(files.keyfile).write_bytes(Path(rotated.keyfile).read_bytes())
    stack.frontend.http.reload_credentials()
    assert served_name() == "second-frontend"


def test_a_connection_that_never_handshakes_is_closed_and_counted(tls_stack: tuple[HttpStack, CertificateAuthority]) -> None:
    """The cap and the header timeout apply before TLS: a silent TCP connection holds a slot, then is closed."""
    stack, _ca = tls_stack
    guard = stack.frontend.http.guard
    wait_until(lambda: guard.open == 0, SHORT.keep_alive_timeout_s + 5, "earlier connections closed")
    with socket.create_connection(("127.0.0.1", stack.frontend.http.bound_port), timeout=5) as sock:
        wait_until(lambda: guard.open == 1, 5, "the TCP connection admitted")
        t0 = time.monotonic()
        assert closed_by_server(sock, SHORT.header_timeout_s + 3)
        assert time.monotonic() - t0 < SHORT.header_timeout_s + 1.5
    wait_until(lambda: guard.open == 0, 5, "its slot released")


def test_plaintext_on_the_tls_port_is_dropped(tls_stack: tuple[HttpStack, CertificateAuthority]) -> None:
    stack, _ca = tls_stack
    with pytest.raises(httpx2.HTTPError):
        httpx2.get(f"http://127.0.0.1:{stack.frontend.http.bound_port}/health", timeout=5)
