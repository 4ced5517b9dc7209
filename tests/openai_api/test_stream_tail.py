"""The end of an SSE stream leaves in one write: the events of the batch that finishes the last
completion, the usage chunk and `data: [DONE]` share one HTTP chunk (frontend_svc/openai/app.py `_stream`),
while every earlier batch is written as it comes. Read over a real socket from the frontend in front of
a fake engine, with HTTP/1.1's chunk boundaries kept."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.openai_api.conftest import HttpStack
from tests.support import LoopThread


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    stack = HttpStack(loop, tokenizer, tiny_model_dir, max_model_len=1024, step_s=0.01)
    stack.wait_http_ready()
    yield stack
    stack.close()


def http_chunks(stack: HttpStack, path: str, body: dict[str, Any]) -> list[bytes]:
    """The response's HTTP chunks (their data, in order; the terminating empty chunk left out)."""
    data = json.dumps(body).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        raw = b""
        while part := conn.recv(1 << 16):
            raw += part
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), raw[:300]
    chunks: list[bytes] = []
    pos = 0
    while True:
        end = rest.index(b"\r\n", pos)
        size = int(rest[pos:end], 16)
        if size == 0:
            return chunks
        chunks.append(rest[end + 2:end + 2 + size])
        pos = end + 2 + size + 2


def events(chunk: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in chunk.decode().split("\n\n") if e]


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": "a lighthouse on a rock"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_the_last_batch_usage_and_done_share_one_write(stack: HttpStack, path: str, extra: dict[str, Any]) -> None:
    body = {"model": str(stack.frontend.config.model_name), "max_tokens": 5, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    chunks = http_chunks(stack, path, body)
    *earlier, last = chunks
    assert events(last)[-1] == "[DONE]"
    tail = [json.loads(e) for e in events(last)[:-1]]
    assert tail[-1]["usage"]["completion_tokens"] == 5 and tail[-1]["choices"] == []
    assert [c["choices"][0]["finish_reason"] for c in tail[:-1]] == ["length"]
    assert len(earlier) >= 2  # the tokens before the last went out as they came (merged only if steps queued)
    for chunk in earlier:
        for event in events(chunk):
            parsed = json.loads(event)
            assert parsed["choices"][0]["finish_reason"] is None and parsed.get("usage") is None


def test_without_usage_the_last_batch_and_done_share_one_write(stack: HttpStack) -> None:
    body = {"model": str(stack.frontend.config.model_name), "max_tokens": 3, "temperature": 1.0, "stream": True,
            "prompt": "a lighthouse", "n": 2}  # both completions finish in the same engine step
    *earlier, last = http_chunks(stack, "/v1/completions", body)
    finished = [json.loads(e)["choices"][0]["index"] for e in events(last)[:-1]]
    assert events(last)[-1] == "[DONE]" and sorted(finished) == [0, 1]
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for c in earlier for e in events(c))
