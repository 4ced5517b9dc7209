"""The /metrics listener (shared_runtime/metrics_http.py) has the limits of the API port: before, each
connection held a thread forever (no timeout, no cap, unbounded headers)."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from shared_runtime.metrics_http import MetricsServer, start_metrics_server
from shared_runtime.security.http_limits import HttpLimits
from tests.support import closed_by_server, slowloris_until_closed, wait_until

LIMITS = HttpLimits(max_header_bytes=4096, header_timeout_s=1.0, body_timeout_s=1.0, max_connections=4, backlog=8)


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Counter("tandem_test_total", "a counter", registry=registry).inc(3)
    s = start_metrics_server("127.0.0.1", 0, registry, LIMITS)
    yield s
    s.shutdown()
    s.server_close()


def port(server: MetricsServer) -> int:
    return int(server.server_address[1])


def scrape(server: MetricsServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port(server)}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_scrape_and_header_limits(server: MetricsServer) -> None:
    assert "tandem_test_total 3.0" in scrape(server)
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.0 431")
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.0 431")




def test_a_slowloris_connection_is_cut_at_its_deadline(server: MetricsServer) -> None:
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        elapsed = slowloris_until_closed(sock, 5)
    deadline = LIMITS.header_timeout_s + LIMITS.body_timeout_s
    assert elapsed is not None and elapsed < deadline + 1.5, elapsed
    wait_until(lambda: server.guard.open == 0, 5, "its slot released")


def test_idle_connections_cannot_lock_out_a_scrape(server: MetricsServer) -> None:
    """The cap is 4: four idle connections are there first, the scrape closes the longest idle one."""
    idle = [socket.create_connection(("127.0.0.1", port(server)), timeout=5) for _ in range(LIMITS.max_connections)]
    try:
        wait_until(lambda: server.guard.open == LIMITS.max_connections, 5, "all admitted")
        assert "tandem_test_total" in scrape(server)
        assert closed_by_server(idle[0], 2.0)
        assert server.guard.evicted >= 1 and server.guard.open <= LIMITS.max_connections
    finally:
        for sock in idle:
            sock.close()
