"""Streamed bodies written straight to the connection (frontend_svc/openai/raw_body.py, sse.EventStream).

Over real sockets in front of the fake engine: the bytes of every kind of stream (plain, logprobs, stop
strings, the usage chunk, n > 1, completions and chat) are the bytes Starlette's per-chunk `send` path
writes for the same request (the edge with `raw_body` off is the oracle), framed as valid HTTP/1.1 chunked
encoding, and the connection serves a keep-alive request after one; a reader that stops reading holds the
frontend's write buffer near the transport's high-water mark (not the stream's whole output), and gets the
whole stream once it reads; a client that leaves while no token is flowing aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import pytest
from h11._writers import ChunkedWriter

from frontend_svc.delta_collector import DeltaCollector
from frontend_svc.openai import raw_body, sse
from frontend_svc.openai.edge import GuardedH11Protocol
from tests.openai_api.conftest import HttpStack
from tests.support import LoopThread, wait_until

PROMPT = "The keeper climbed the stairs, counted each step, and lit the lamp at the top."
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat plain": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24}),
    "chat logprobs + usage": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "logprobs": True, "top_logprobs": 3,
        "stream_options": {"include_usage": True}}),
    "chat n=3": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
                                          "n": 3, "stream_options": {"include_usage": True}}),
    "completions stop strings": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 40,
                                                     "stop": ["lit the", "zebra"]}),
    "completions logprobs, n=2, two prompts": ("/v1/completions", {
        "prompt": [PROMPT, "Waves broke below."], "max_tokens": 10, "n": 2, "logprobs": 2,
        "stream_options": {"include_usage": True}}),
}


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    s = HttpStack(loop, tokenizer, tiny_model_dir, step_s=0.002, max_model_len=65_536)
    s.wait_http_ready()
    yield s
    s.close()


def request_bytes(stack: HttpStack, path: str, body: dict[str, Any], request_id: str) -> tuple[h11.Request, bytes]:
    data = json.dumps({**body, "model": str(stack.frontend.config.model_name), "stream": True}).encode()
    headers = [("Host", "x"), ("Content-Type", "application/json"), ("Content-Length", str(len(data))),
               ("X-Request-Id", request_id)]
    return h11.Request(method="POST", target=path, headers=headers), data


def exchange(port: int, requests: list[tuple[h11.Request, bytes]]) -> list[tuple[int, list[tuple[bytes, bytes]], bytes]]:
    """The requests one after another on one keep-alive connection, each response parsed by h11's client
    (which rejects bad chunk framing): (status, headers without Date, body)."""
    conn = h11.Connection(h11.CLIENT)
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for request, data in requests:
            sock.sendall(conn.send(request) + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
            status, headers, body = 0, [], bytearray()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    chunk = sock.recv(65536)
                    conn.receive_data(chunk)
                    continue
                if isinstance(event, h11.Response):
                    status, headers = event.status_code, [(k, v) for k, v in event.headers if k != b"date"]
                    assert (b"transfer-encoding", b"chunked") in event.headers
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            out.append((status, headers, bytes(body)))
            conn.start_next_cycle()
    return out


def normalized(body: bytes) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', body)


def by_choice(body: bytes) -> dict[str, list[bytes]]:
    """The events of each choice index in order (n > 1 and several prompts interleave their choices in the
    order their outputs reach the frontend, which varies from run to run on either path)."""
    out: dict[str, list[bytes]] = {}
    for event in normalized(body).split(b"\n\n"):
        data = event.removeprefix(b"data: ")
        choices = json.loads(data).get("choices") if data.startswith(b"{") else None
        key = ",".join(str(c["index"]) for c in choices) if choices else data[:20].decode()
        out.setdefault(key, []).append(event)
    return out


@pytest.fixture
def counted_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the chunks `RawBody.write` wrote (so a test knows the raw path was taken)."""
    sizes: list[int] = []
    original = raw_body.RawBody.write

    async def write(self: raw_body.RawBody, data: bytes) -> bool:
        sizes.append(len(data))
        return await original(self, data)

    monkeypatch.setattr(raw_body.RawBody, "write", write)
    return sizes


def test_raw_streams_are_the_bytes_of_the_send_path(stack: HttpStack, counted_writes: list[int],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    port = stack.frontend.http.bound_port
    requests = [request_bytes(stack, path, body, f"raw-{i}") for i, (path, body) in enumerate(CASES.values())]
    raw = exchange(port, requests)  # one keep-alive connection: each stream leaves it ready for the next
    assert counted_writes, "the raw path was not taken"
    monkeypatch.setattr(GuardedH11Protocol, "raw_body", False)
    counted_writes.clear()
    reference = exchange(port, requests)
    assert not counted_writes
    for name, (status, headers, body), (ref_status, ref_headers, ref_body) in zip(CASES, raw, reference):
        assert status == ref_status == 200, name
        assert headers == ref_headers, name
        assert body.endswith(sse.DONE.encode()) and body.count(b"data: ") > 3, name
        assert len(body) == len(ref_body), name
        assert by_choice(body) == by_choice(ref_body), name
    stack.wait_engine_idle(timeout=5)


def test_a_kept_up_stream_wakes_its_task_for_its_end_not_per_token(
        stack: HttpStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each token of a stream whose client keeps up is written by the engine step's processing (the
    generation's sink): the stream's own task takes output from its collector once (the finish), where
    the `send` path (the oracle, same request) takes it once per step; the bodies are the same."""
    taken: list[int] = []
    original = DeltaCollector.get

    async def get(self: DeltaCollector) -> list[Any]:
        deltas = await original(self)
        taken.append(len(deltas))
        return deltas

    monkeypatch.setattr(DeltaCollector, "get", get)
    max_tokens = 40
    request = request_bytes(stack, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
        "stream_options": {"include_usage": True}}, "wakeups")
    port = stack.frontend.http.bound_port
    [(status, _, body)] = exchange(port, [request])
    direct = len(taken)
    monkeypatch.setattr(GuardedH11Protocol, "raw_body", False)
    taken.clear()
    [(ref_status, _, ref_body)] = exchange(port, [request])
    assert status == ref_status == 200
    assert normalized(body) == normalized(ref_body)
    assert json.loads(body.split(b"data: ")[-2])["usage"]["completion_tokens"] == max_tokens
    assert direct == 1, f"the stream's task took output {direct} times for {max_tokens} tokens"
    assert len(taken) > max_tokens // 4  # the oracle's task wakes per step (merged only when it lags)
    stack.wait_engine_idle(timeout=5)


def test_a_reader_that_stops_reading_holds_the_buffer_at_the_high_water_mark(
        stack: HttpStack, loop: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Big events (n=8, top-20 logprobs) into a socket nobody reads for 1.2 s: without backpressure the
    frontend's buffer takes the stream's whole output (megabytes); with it, the high-water mark (64 KiB)
    plus a chunk. Then the reader reads everything: every token arrives, and the request ends."""
    bodies: list[raw_body.RawBody] = []

    class Recorded(raw_body.RawBody):
        __slots__ = ()

        def __init__(self, cycle: Any) -> None:
            super().__init__(cycle)
            # a small kernel buffer, so that what the reader does not take piles up in the transport
            cycle.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
            bodies.append(self)

    monkeypatch.setattr(raw_body, "RawBody", Recorded)
    n, max_tokens = 8, 1500
    request, data = request_bytes(stack, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": max_tokens, "n": n, "logprobs": 20,
        "stream_options": {"include_usage": True}}, "slow-reader")
    conn = h11.Connection(h11.CLIENT)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    most = 0
    try:
        sock.connect(("127.0.0.1", stack.frontend.http.bound_port))
        sock.sendall(conn.send(request) + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
        wait_until(lambda: len(bodies) == 1 and len(stack.fake.running) == n, 10, "the stream started")
        transport = bodies[0]._transport

        async def buffered() -> int:
            return int(transport.get_write_buffer_size())

        for _ in range(12):  # 1.2 s without reading
            time.sleep(0.1)
            most = max(most, loop.run(buffered()))
        assert stack.fake.running, "the stream ended while its reader was not reading"
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(1 << 20))
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
    finally:
        sock.close()
    assert most <= 64 * 1024 + 256 * 1024, f"{most} bytes buffered for a reader that did not read"
    usage = json.loads(body.split(b"data: ")[-2])["usage"]
    assert usage["completion_tokens"] == n * max_tokens
    assert body.endswith(sse.DONE.encode())
    stack.wait_engine_idle(timeout=5)


def test_a_client_that_leaves_while_no_token_flows_aborts_the_request(loop: LoopThread) -> None:
    """The disconnect watch, alone: the body waits for a token that never comes, the client disconnects,
    and the response ends: the body iterator is closed and `on_close` runs, once."""
    closed: list[str] = []
    disconnect = asyncio.Event()
    writes: list[bytes] = []

    class Cycle:
        response_started = False
        disconnected = False
        conn = type("Conn", (), {"_writer": ChunkedWriter()})()
        flow = type("Flow", (), {"write_paused": False})()

        class transport:  # stands in for an asyncio transport
            @staticmethod
            def write(data: bytes) -> None:
                writes.append(data)

    cycle = Cycle()

    async def body() -> Any:
        try:
            yield sse.event("{}")
            await asyncio.Event().wait()  # no token, ever
            yield sse.DONE
        finally:
            closed.append("iterator")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            cycle.response_started = True

    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        scope = {"type": "http", "method": "POST", "extensions": {raw_body.RAW_BODY: raw_body.RawBody(cycle)}}
        response = sse.EventStream(body(), on_close=lambda: closed.append("on_close"))
        task = asyncio.ensure_future(response(scope, receive, send))
        await asyncio.sleep(0.05)
        assert not task.done() and writes == [b"a\r\ndata: {}\n\n\r\n"]
        disconnect.set()
        await asyncio.wait_for(task, 5)

    loop.run(run())
    assert closed == ["iterator", "on_close"]


def test_a_client_that_leaves_while_tokens_flow_aborts_the_request(stack: HttpStack) -> None:
    """The chunks of a kept-up stream are written by the engine step's processing, not the response's task:
    a client that closes its connection mid-stream still ends the request in the engine at once (the
    response's disconnect watch), and nothing is left admitted."""
    request, data = request_bytes(stack, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20_000}, "leaves")
    conn = h11.Connection(h11.CLIENT)
    received = bytearray()
    with socket.create_connection(("127.0.0.1", stack.frontend.http.bound_port), timeout=30) as sock:
        sock.sendall(conn.send(request) + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
        while received.count(b"data: ") < 30:
            received += sock.recv(65536)
        assert stack.fake.running
    stack.wait_engine_idle(timeout=5)  # 20,000 tokens at 2 ms a step would take 40 s
