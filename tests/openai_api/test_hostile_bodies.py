"""What one anonymous HTTP client could still do to everyone else (fake engine, real sockets, a victim SSE
stream during every attack): refused requests kept in reference cycles, big bodies parsed before their
counts were checked, JSON nested too deeply for the parser, ids echoed back whole.

Memory is this process's resident size (the server, the fake engine and the clients share it), read
after a few attacks (the allocator's arenas grow to their working size over the first ones, then stay)
and again after many more: what the attacks leave behind, not what they use while they run.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.openai_api.conftest import HttpStack, SseReader
from tests.support import MAX_STALL_S, LoopThread

BIG_CONTEXT = 131_072
MiB = 2**20


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    """A long context (so big prompts pass the body's pre-checks and reach the count checks), 8 MiB bodies."""
    stack = HttpStack(loop, tokenizer, tiny_model_dir, max_model_len=BIG_CONTEXT, step_s=0.01,
                      max_message_bytes=8 * MiB)
    stack.wait_http_ready()
    yield stack
    stack.close()


@pytest.fixture
def victim(stack: HttpStack) -> Iterator[SseReader]:
    reader = SseReader(f"{stack.url}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": None, "stream": True})
    reader.wait_started()
    yield reader
    reader.stop()
    assert reader.error is None, reader.error
    stack.wait_engine_idle()


def resident() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def post(stack: HttpStack, path: str, content: bytes) -> httpx2.Response:
    return httpx2.post(f"{stack.url}{path}", content=content, headers={"Content-Type": "application/json"},
                       timeout=60)


# ---- refused requests leave nothing behind ---------------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [5] * 300_000, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 40_000, "max_tokens": 4,
                              "use_beam_search": True}),  # refused by name (raise_if)
    ("/detokenize", {"tokens": [5] * 300_000}),
])
def test_refused_requests_are_freed_by_reference_counting_alone(stack: HttpStack, victim: SseReader, path: str,
                                                                body: dict[str, Any]) -> None:
    """Before: the refused call's task, its exception and the traceback's frames formed cycles holding the
    parsed prompt (~14.5 MB per 1.9M-id request kept until a full collection: 80 requests grew the
    frontend 1.2 GB). With the collector off, whatever a refusal leaves in a cycle stays: nothing may."""
    content = json.dumps(body).encode()
    gc.collect()
    gc.disable()
    try:
        assert [post(stack, path, content).status_code for _ in range(5)] == [400] * 5
        settled = resident()

        def attack() -> list[int]:
            return [post(stack, path, content).status_code for _ in range(20)]

        codes, gap = victim.during(f"20 refused {path}", attack)
        grown = resident() - settled
    finally:
        gc.enable()
    print(f"[memory] {path}: {len(content) / 1e6:.1f} MB bodies; resident +{grown / MiB:.1f} MiB after 20 more")
    assert codes == [400] * 20
    assert grown < 24 * MiB, f"20 refused requests left {grown / MiB:.0f} MiB behind"
    assert gap < MAX_STALL_S, f"victim stalled {gap * 1000:.0f} ms"


# ---- malformed JSON ---------------------------------------------------------------------------------------

def test_json_nested_too_deeply_for_the_parser_is_400_without_a_traceback(
        stack: HttpStack, victim: SseReader, caplog: pytest.LogCaptureFixture) -> None:
    """Before: /tokenize answered 500 and logged two tracebacks (json.loads raised RecursionError)."""
    nested = b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    with caplog.at_level(logging.WARNING):
        answer, gap = victim.during("/tokenize nested 30,000 levels", lambda: post(stack, "/tokenize", nested))
    assert answer.status_code == 400, answer.text
    assert "nested too deeply" in answer.json()["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert gap < MAX_STALL_S


# ---- what errors echo -------------------------------------------------------------------------------------

def test_errors_quote_at_most_the_start_of_a_clients_string(stack: HttpStack, victim: SseReader) -> None:
    """Before: the 404 for an unknown 3 MB previous_response_id echoed it whole (a 3 MB answer); so did an
    unknown model name, and a body with 100k bad entries got one message per entry."""
    model = stack.frontend.config.model_name
    huge = "resp_" + "a" * 3_000_000
    cases = [
        ("/v1/responses", {"model": model, "input": "hi", "previous_response_id": huge}, 404, "previous_response_id"),
        ("/v1/completions", {"model": "m" * 3_000_000, "prompt": "hi"}, 404, "model"),
        ("/detokenize", {"tokens": ["x"] * 100_000}, 400, "tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "t" * 1_000_000}]}]}, 400,
         "content part type"),
    ]
    for path, body, status, what in cases:
        content = json.dumps(body).encode()
        answer, gap = victim.during(f"{what} echoed", lambda: post(stack, path, content))  # noqa: B023
        assert answer.status_code == status, answer.text[:300]
        message = answer.json()["error"]["message"]
        print(f"[echo] {what}: a {len(answer.content):,}-byte answer: {message[:160]!r}")
        assert len(answer.content) < 2048, f"{what}: a {len(answer.content)}-byte answer"
        assert gap < MAX_STALL_S
    retrieve = httpx2.get(f"{stack.url}/v1/responses/{'b' * 30_000}", timeout=30)
    assert retrieve.status_code == 404 and len(retrieve.content) < 2048
    assert "(30000 characters)" in retrieve.json()["error"]["message"]
