"""Where a request's prompt is prepared (validated, rendered, tokenized): a small request (a body or gRPC
message of at most `INLINE_PREPARE_BYTES`, the model's chat template) on the event loop, with no hand-off
to the tokenizer pool; a larger one, or one with its own chat template, on the pool (frontend_svc/generation.py).
Both give the same answer; a refused small request still releases its admission slot."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from frontend_svc.client import TandemClient
from frontend_svc.generation import INLINE_PREPARE_BYTES, prepares_inline
from tests.openai_api.conftest import HttpStack
from tests.support import LoopThread

BIG_CONTEXT = 8192
SMALL = "a short prompt about lighthouses"
LARGE = "lighthouse " * (INLINE_PREPARE_BYTES // 10)  # a body over the bound, a prompt within the context


class Where:
    """Wraps the frontend's `process` (what every prepare calls) to record the thread each prepare ran on."""

    def __init__(self, stack: HttpStack) -> None:
        self.threads: list[threading.Thread] = []
        self._process = stack.frontend.process
        self._loop_thread = stack.loop.thread
        stack.frontend.process = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread())
        return self._process(*args, **kwargs)

    def take(self) -> list[str]:
        """"loop" or "pool" for each prepare since the last call."""
        out = ["loop" if t is self._loop_thread else "pool" for t in self.threads]
        self.threads.clear()
        return out


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    stack = HttpStack(loop, tokenizer, tiny_model_dir, max_model_len=BIG_CONTEXT, step_s=0.002)
    stack.wait_http_ready()
    yield stack
    stack.close()


@pytest.fixture()
def where(stack: HttpStack) -> Iterator[Where]:
    recorder = Where(stack)
    yield recorder
    del stack.frontend.process  # the method again


def completion(stack: HttpStack, prompt: Any, **extra: Any) -> httpx2.Response:
    body = {"model": str(stack.frontend.config.model_name), "prompt": prompt, "max_tokens": 3,
            "temperature": 0.0, **extra}
    return httpx2.post(f"{stack.url}/v1/completions", json=body, timeout=30)


def completion_body(stack: HttpStack, prompt: str) -> bytes:
    return json.dumps({"model": str(stack.frontend.config.model_name), "prompt": prompt, "max_tokens": 3}).encode()


def test_the_rule() -> None:
    assert prepares_inline(INLINE_PREPARE_BYTES)
    assert not prepares_inline(INLINE_PREPARE_BYTES + 1)
    assert not prepares_inline(None)  # a chunked body: its size is not known before it is read
    assert not prepares_inline(100, chat_template="{{ messages }}")  # a per-request template: arbitrary work


def test_small_http_requests_are_prepared_on_the_loop_large_ones_on_the_pool(stack: HttpStack,
                                                                              where: Where) -> None:
    small = completion(stack, SMALL, stream=True, stream_options={"include_usage": True})
    assert small.status_code == 200 and "[DONE]" in small.text
    chat = httpx2.post(f"{stack.url}/v1/chat/completions", timeout=30, json={
        "model": str(stack.frontend.config.model_name), "max_tokens": 3,
        "messages": [{"role": "user", "content": SMALL}]})
    assert chat.status_code == 200, chat.text
    assert where.take() == ["loop", "loop"]

    large = completion(stack, LARGE)
    assert large.status_code == 200, large.text
    chunked = httpx2.post(f"{stack.url}/v1/completions", timeout=30, headers={"Content-Type": "application/json"},
                          content=iter([completion_body(stack, SMALL)]))
    assert chunked.status_code == 200, chunked.text
    assert where.take() == ["pool", "pool"]


def test_the_same_answer_either_way(stack: HttpStack, where: Where) -> None:
    """The fake engine echoes the prompt's tokens: a small prompt's ids, tokenized on the loop, are the
    first ids of the same text padded past the bound with spaces (whose prepare runs on the pool)."""
    ids = completion(stack, SMALL, echo=False, max_tokens=6, return_token_ids=True).json()
    padded = completion(stack, SMALL + " " * INLINE_PREPARE_BYTES, max_tokens=6, return_token_ids=True).json()
    assert where.take() == ["loop", "pool"]
    assert ids["choices"][0]["prompt_token_ids"] == padded["choices"][0]["prompt_token_ids"][:len(
        ids["choices"][0]["prompt_token_ids"])]


def test_a_refused_small_request_releases_its_slot(stack: HttpStack, where: Where) -> None:
    answer = completion(stack, [stack.frontend.vocab_size + 7])
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt", answer.text
    assert where.take() == ["loop"]
    stack.wait_engine_idle()
    assert stack.frontend.admission.in_use == 0


def test_grpc_generate_small_on_the_loop_large_on_the_pool(stack: HttpStack, where: Where) -> None:
    with TandemClient(stack.address) as client:
        for prompt in (SMALL, LARGE):
            responses = list(client.generate(prompt, max_tokens=3, timeout=30))
            assert sum(len(r.token_ids) for r in responses) == 3
    assert where.take() == ["loop", "pool"]


def test_a_small_request_starts_without_racing_a_disconnect_watch(stack: HttpStack, where: Where,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepared on the loop, a one-prompt request's start never waits, so no watch task is set up for it
    (`unless_disconnected`); a request prepared on the pool, or with several prompts, still gets one."""
    from frontend_svc.openai.http_io import unless_disconnected as real

    raced: list[str] = []

    async def counting(request: Any, work: Any) -> Any:
        raced.append(request.url.path)
        return await real(request, work)

    monkeypatch.setattr("frontend_svc.openai.app.unless_disconnected", counting)
    assert completion(stack, SMALL, stream=True).status_code == 200
    assert raced == []
    assert completion(stack, LARGE, stream=True).status_code == 200
    assert completion(stack, [SMALL, SMALL]).status_code == 200
    assert raced == ["/v1/completions", "/v1/completions"]
    assert where.take() == ["loop", "pool", "loop", "loop"]
