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


@pytest.fixture(scope="module", autouse=True)
def settled_heap() -> Iterator[None]:
    """What a serving frontend does after start-up (shared_runtime/heap.py, without its watch): the
    collector no longer scans what the test process built (torch, the tokenizer...), whose full
    collections would otherwise pause the server for hundreds of ms at random points."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


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


# ---- big parseable bodies -----------------------------------------------------------------------------

SINGLE_BODY_STALL_S = 0.25  # a quiet machine: < 0.1 s (the bound); here it shares 2 cores


def concurrently(count: int, fn: Any) -> list[Any]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: fn(), range(count)))


def test_bodies_past_their_counts_are_refused_before_parsing(stack: HttpStack, victim: SseReader) -> None:
    """Before: every body was parsed whole (pydantic holds the GIL, so a parse on a thread stalls every
    stream) and only then counted: one 3.6 MB Responses body with 100k input items stalled streams 345 ms,
    eight 1.45 s and +790 MB; eight 1.9M-id /detokenize or completions 430-520 ms. Now commas and braces
    are counted on the raw bytes first (here at most 590,336 and 69,632)."""
    model = stack.frontend.config.model_name
    ids = [5] * 1_900_000
    items = [{"role": "user", "content": "x"}] * 100_000
    cases = [
        ("1 x Responses, 100k items", 1, "/v1/responses", {"model": model, "input": items}, "objects"),
        ("8 x Responses, 100k items", 8, "/v1/responses", {"model": model, "input": items}, "objects"),
        ("8 x /detokenize, 1.9M ids", 8, "/detokenize", {"tokens": ids}, "commas"),
        ("8 x completions, 1.9M ids", 8, "/v1/completions", {"prompt": ids, "max_tokens": 4}, "commas"),
    ]
    settled = resident()
    for label, count, path, body, what in cases:
        content = json.dumps(body, separators=(",", ":")).encode()
        answers, gap = victim.during(f"{label} ({len(content) / 1e6:.1f} MB)",
                                     lambda: concurrently(count, lambda: post(stack, path, content)))  # noqa: B023
        assert [a.status_code for a in answers] == [400] * count, answers[0].text[:200]
        assert all(what in a.json()["error"]["message"] for a in answers), answers[0].text[:200]
        assert gap < (SINGLE_BODY_STALL_S if count == 1 else MAX_STALL_S), f"{label}: victim stalled {gap * 1000:.0f} ms"
    grown = resident() - settled
    print(f"[memory] resident +{grown / MiB:.1f} MiB after the 25 bodies")
    assert grown < 64 * MiB


def test_bodies_within_their_counts_are_parsed_one_at_a_time(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The largest bodies a model of 8k context accepts (8,000 objects: 4,000 Responses items with content
    parts), eight at once: each is parsed on a thread, one at a time, so the loop runs between two."""
    import threading
    import time

    from frontend_svc.openai import responses_protocol as rp

    parsing, most = [0], [0]
    lock = threading.Lock()
    validate = rp.ResponsesRequest.model_validate_json

    def counted(data: Any) -> Any:
        with lock:
            parsing[0] += 1
            most[0] = max(most[0], parsing[0])
        try:
            time.sleep(0.01)  # a parse that overlapped another would show here
            return validate(data)
        finally:
            with lock:
                parsing[0] -= 1

    monkeypatch.setattr(rp.ResponsesRequest, "model_validate_json", counted)
    small = HttpStack(loop, tokenizer, tiny_model_dir, max_model_len=8192, step_s=0.01)
    try:
        small.wait_http_ready()
        reader = SseReader(f"{small.url}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": None, "stream": True})
        reader.wait_started()
        item = {"role": "user", "content": [{"type": "input_text", "text": "hello"}]}
        body = {"model": small.frontend.config.model_name, "input": [item] * 4000, "background": True}
        content = json.dumps(body).encode()  # refused right after parsing (background), before any render
        answers, gap = reader.during(f"8 x Responses, 4,000 items ({len(content) / 1e6:.1f} MB)",
                                     lambda: concurrently(8, lambda: post(small, "/v1/responses", content)))
        reader.stop()
        assert reader.error is None
    finally:
        small.close()
    assert [a.status_code for a in answers] == [400] * 8 and "background" in answers[0].json()["error"]["message"]
    assert most[0] == 1, f"{most[0]} parses ran at once"
    assert gap < MAX_STALL_S, f"victim stalled {gap * 1000:.0f} ms"


# ---- grammar compiles ------------------------------------------------------------------------------------

def test_schemas_that_would_compile_for_minutes_are_refused_at_once(stack: HttpStack, victim: SseReader) -> None:
    """The issue's attack: 800 nested objects and 1,000 nested arrays as structured_outputs.json kept the
    engine's two compile threads busy for minutes (and ~1 GB); every other client's constraint then
    failed at 30 s. The frontend now refuses both by their nesting, before any engine sees them."""
    objects = '{"type":"object","required":["a"],"properties":{"a":' * 800 + '{"type":"integer"}' + "}}" * 800
    arrays = '{"type":"array","items":' * 1000 + '{"type":"integer"}' + "}" * 1000
    added = len(stack.fake.added)
    for schema in (objects, arrays):
        body = json.dumps({"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": schema}}).encode()
        answer, gap = victim.during(f"a {len(body) // 1000} KB nested schema",
                                    lambda: post(stack, "/v1/completions", body))  # noqa: B023
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == "structured_outputs.json", answer.text[:300]
        assert "would cost too much to compile" in error["message"] and "nests more than 64" in error["message"]
        assert answer.elapsed.total_seconds() < 1.0
        assert gap < MAX_STALL_S
    assert len(stack.fake.added) == added  # nothing reached the engine
    ok = post(stack, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2,
                                                     "structured_outputs": {"regex": "[0-9]{3}"}}).encode())
    assert ok.status_code == 200, ok.text


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
