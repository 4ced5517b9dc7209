"""The OpenAI HTTP API over real sockets, in front of a fake engine (fast): API keys, admission (429),
readiness (503), body limits (413) with a victim stream that must not stall, client disconnects that
must abort in the engine, OpenAI-shaped errors, and HTTPS with the frontend's certificate."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from shared_runtime.security.tls import TlsFiles
from tests.openai_api.conftest import HttpStack, SseReader
from tests.security.certs import CertificateAuthority
from tests.support import MAX_STALL_S, LoopThread, wait_until

KEY = "sk-openai-test-5150"
BIG_CONTEXT = 131_072


def served(stack: HttpStack) -> str:
    return str(stack.frontend.config.model_name)


def client(stack: HttpStack, key: str = "none", **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=30, **kwargs)


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    """Keys on, at most 4 completions in flight, a long context (so streams can run for seconds)."""
    stack = HttpStack(loop, tokenizer, tiny_model_dir, api_keys=(KEY,), max_concurrent_requests=4,
                      max_model_len=BIG_CONTEXT, step_s=0.01)
    stack.wait_http_ready()
    yield stack
    stack.close()


def test_api_keys_guard_every_route_but_health_and_ping(stack: HttpStack) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(stack).completions.create(model="x", prompt="hi", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        client(stack, KEY[:-1]).models.list()
    assert httpx2.get(f"{stack.url}/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    assert httpx2.get(f"{stack.url}/health").status_code == 200  # probes carry no key
    assert httpx2.post(f"{stack.url}/ping").status_code == 200
    assert httpx2.post(f"{stack.url}/tokenize", json={"prompt": "hi"}).status_code == 401
    models = client(stack, KEY).models.list()
    assert [m.id for m in models.data] == [stack.frontend.config.model_name]
    done = client(stack, KEY).completions.create(model=models.data[0].id, prompt=[5, 6, 7], max_tokens=3)
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 3


def test_over_the_completion_limit_is_429_and_alone_over_it_is_400(stack: HttpStack) -> None:
    busy = SseReader(f"{stack.url}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": None, "n": 3,
                                                     "stream": True}, {"Authorization": f"Bearer {KEY}"})
    try:
        busy.wait_started()
        with pytest.raises(openai.RateLimitError) as info:
            client(stack, KEY).completions.create(prompt=[5], max_tokens=2, n=2, model=served(stack))
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
        one = client(stack, KEY).completions.create(prompt=[5], max_tokens=2, model=served(stack))
        assert one.choices[0].text is not None  # a single completion still fits (3 + 1 <= 4)
    finally:
        busy.stop()
    stack.wait_engine_idle()
    with pytest.raises(openai.BadRequestError) as bad:
        client(stack, KEY).completions.create(prompt=[5], max_tokens=2, n=5, model=served(stack))
    assert bad.value.body["param"] == "n"  # type: ignore[index]


def test_disconnect_mid_stream_aborts_the_request_in_the_engine(stack: HttpStack) -> None:
    reader = SseReader(f"{stack.url}/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True},
                       {"Authorization": f"Bearer {KEY}"})
    reader.wait_started()
    assert len(stack.fake.running) == 2
    reader.stop()
    stack.wait_engine_idle(timeout=5)


def test_disconnect_before_a_non_streaming_response_aborts_too(stack: HttpStack) -> None:
    body = json.dumps({"prompt": [5, 6], "max_tokens": None}).encode()
    with socket.create_connection(("127.0.0.1", stack.frontend.http.bound_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: len(stack.fake.running) == 1, 10, "the request reached the engine")
    stack.wait_engine_idle(timeout=5)


def test_errors_have_openai_shape_and_the_right_param(stack: HttpStack) -> None:
    c = client(stack, KEY)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=served(stack), messages=[{"role": "user", "content": "x"}], top_p=1.5)
    assert info.value.body == {"message": "top_p: must be in (0, 1], got 1.5", "type": "invalid_request_error",
                               "param": "top_p", "code": None}
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=served(stack), prompt="x", max_tokens=BIG_CONTEXT + 1)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]  # max_tokens > the context itself
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=served(stack), prompt=[1_000_000])
    assert info.value.body["param"] == "prompt"  # type: ignore[index]  # token id >= vocab
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="gpt-4o", prompt="x")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    auth = {"Authorization": f"Bearer {KEY}"}
    nowhere = httpx2.post(f"{stack.url}/v1/embeddings", json={}, headers=auth)
    assert nowhere.status_code == 404 and "error" in nowhere.json()
    not_json = httpx2.post(f"{stack.url}/v1/completions", content=b"{", headers=auth)
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    named = httpx2.post(f"{stack.url}/v1/completions", json={"prompt": [5], "max_tokens": 1},
                        headers={**auth, "X-Request-Id": "trace-me-42"})
    assert named.headers["x-request-id"] == "trace-me-42" and named.json()["id"] == "cmpl-trace-me-42"


@pytest.mark.parametrize("field, value", [("priority", 2**31), ("top_k", 2**31), ("min_tokens", 2**32),
                                          ("stop_token_ids", [2**32])])
def test_integers_beyond_the_engine_contract_are_400_and_leave_nothing_behind(stack: HttpStack, field: str,
                                                                            value: Any) -> None:
    """JSON integers are unbounded; the engine contract's fields are 32-bit. Too large is a 400 naming the
    field, and no request is left registered with an engine connection (it would skew routing forever)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    response = httpx2.post(f"{stack.url}/v1/completions", headers=auth,
                           json={"prompt": "x", "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    stack.wait_engine_idle()
    assert all(not c.requests for c in stack.frontend.engines.connections())


def test_request_bodies_over_the_limit_are_413_and_never_stall_another_stream(stack: HttpStack) -> None:
    """A declared 64 MiB body is refused from its headers; a chunked one once the limit is crossed; bodies
    just under the limit (a 3.9 MB text prompt, 3.9 MB of token ids) are parsed on a thread and
    tokenized on the pool. A victim stream keeps its pace through all four."""
    limit = stack.frontend.config.max_message_bytes
    port = stack.frontend.http.bound_port
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n")

    def declared_huge() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b"Content-Length: 67108864\r\n\r\n" + b'{"prompt": "')
            return sock.recv(4096)

    def chunked_huge() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * 65536
            try:
                for _ in range(limit // len(chunk) + 8):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                pass  # the server answered and closed while we were still sending
            return sock.recv(4096)

    def just_under() -> int:
        prompt = "The quick brown fox jumps over the lazy dog. " * (3_900_000 // 45)
        answer = httpx2.post(f"{stack.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        return answer.status_code

    def ids_just_under() -> int:
        ids = list(range(10, 400)) * 1300  # ~3.9 MB of JSON: 507k token ids, far past the context
        answer = httpx2.post(f"{stack.url}/v1/completions", json={"prompt": ids, "max_tokens": 1},
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        return answer.status_code

    victim = SseReader(f"{stack.url}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": None, "stream": True},
                       {"Authorization": f"Bearer {KEY}"})
    try:
        victim.wait_started()
        attacks = ((declared_huge, b" 413 "), (chunked_huge, b" 413 "), (just_under, 400), (ids_just_under, 400))
        for attack, expect in attacks:
            result, gap = victim.during(attack.__name__, attack)
            if isinstance(result, bytes):
                assert expect in result.split(b"\r\n", 1)[0], result[:200]
            else:
                assert result == expect  # the prompt is longer than the context: rejected after tokenizing
            assert gap < MAX_STALL_S
    finally:
        victim.stop()
    assert victim.error is None
    stack.wait_engine_idle()


def test_health_is_503_while_draining_and_without_an_engine(loop: LoopThread, tokenizer: Any,
                                                            tiny_model_dir: Path) -> None:
    stack = HttpStack(loop, tokenizer, tiny_model_dir)
    try:
        stack.wait_http_ready()
        stack.frontend.draining = True  # what drain() sets first (the real drain also stops the server)
        assert httpx2.get(f"{stack.url}/health").json() == {"status": "draining"}
        with pytest.raises(openai.InternalServerError) as info:
            client(stack).completions.create(model=served(stack), prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "draining"  # type: ignore[index]
        assert info.value.response.headers["retry-after"] == "1"
        stack.frontend.draining = False
        loop.run(stack.engine_server.stop(None))
        wait_until(lambda: httpx2.get(f"{stack.url}/health").status_code == 503, 15, "/health 503")
        with pytest.raises(openai.InternalServerError) as info:
            client(stack).completions.create(model=served(stack), prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "no_ready_engine"  # type: ignore[index]
    finally:
        stack.close()


def test_https_with_the_frontend_certificate_and_client_certificates(loop: LoopThread, tokenizer: Any,
                                                                    tiny_model_dir: Path, tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path, "http-ca")
    server, user = ca.issue("tandem-frontend"), ca.issue("user", client=True)
    stack = HttpStack(loop, tokenizer, tiny_model_dir,
                      tls=TlsFiles(str(server.certfile), str(server.keyfile), str(ca.certfile)))
    try:
        url = f"https://127.0.0.1:{stack.frontend.http.bound_port}/health"
        context = ssl.create_default_context(cafile=str(ca.certfile))
        context.load_cert_chain(str(user.certfile), str(user.keyfile))
        wait_until(lambda: httpx2.get(url, verify=context).status_code == 200, 15, "HTTPS /health 200",
                   retry_on=(httpx2.HTTPError,))
        with pytest.raises(httpx2.HTTPError):  # no client certificate: the handshake fails
            httpx2.get(url, verify=ssl.create_default_context(cafile=str(ca.certfile)))
        with pytest.raises(httpx2.HTTPError):  # plaintext is not served on the TLS port
            httpx2.get(url.replace("https", "http"))
    finally:
        stack.close()


def test_drain_lets_streams_finish_and_fails_what_outlives_the_grace(loop: LoopThread, tokenizer: Any,
                                                                    tiny_model_dir: Path) -> None:
    """SIGTERM's drain: /health and new requests 503 at once; a stream that ends within the grace period
    ends normally; one that outlives it gets an error event (the status line already said 200) and
    [DONE]; then the HTTP port closes."""
    stack = HttpStack(loop, tokenizer, tiny_model_dir, max_model_len=BIG_CONTEXT, step_s=0.01, drain_grace_s=1.5)
    stack.wait_http_ready()
    url = f"{stack.url}/v1/completions"
    short = SseReader(url, {"prompt": [5, 6, 7], "max_tokens": 40, "stream": True})
    endless = SseReader(url, {"prompt": [5, 6, 7], "max_tokens": None, "stream": True})
    short.wait_started(3)
    endless.wait_started(3)
    draining = asyncio.run_coroutine_threadsafe(stack.frontend.drain(), loop.loop)
    try:
        wait_until(lambda: httpx2.get(f"{stack.url}/health").status_code == 503, 5, "/health 503")
        refused = httpx2.post(url, json={"prompt": [5], "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        draining.result(30)
    finally:
        short.stop()
        endless.stop()
        loop.run(stack.engine_server.stop(None))
    assert short.error is None and short.events[-1] == "[DONE]"
    assert json.loads(short.events[-2])["choices"][0]["finish_reason"] == "length"
    assert endless.error is None and endless.events[-1] == "[DONE]"
    failure = json.loads(endless.events[-2])
    assert failure["error"]["type"] == "server_error" and failure["error"]["code"] == "draining"
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(f"{stack.url}/health")


def test_priority_and_token_filters_reach_the_engine(stack: HttpStack) -> None:
    """The OpenAI fields that become engine fields arrive there: priority, allowed_token_ids, and bad_words
    as token-id sequences (tokenized by the frontend, as vLLM does: plain and with a leading space)."""
    c = client(stack, KEY)
    before = len(stack.fake.added)
    c.completions.create(model=served(stack), prompt=[5, 6], max_tokens=2,
                         extra_body={"priority": 7, "allowed_token_ids": [3, 9], "bad_words": ["hello"]})
    sent = stack.fake.added[before]
    assert sent.priority == 7 and list(sent.sampling_params.allowed_token_ids) == [3, 9]
    words = [list(s.token_ids) for s in sent.sampling_params.bad_words_token_ids]
    plain = stack.frontend.tokenizer.encode("hello", add_special_tokens=False)
    assert words[0] == plain and all(w for w in words)


def test_a_request_chat_template_is_refused_unless_trusted(stack: HttpStack, loop: LoopThread, tokenizer: Any,
                                                           tiny_model_dir: Path) -> None:
    """vLLM's --trust-request-chat-template: a template is code (one can loop for minutes even sandboxed),
    so a request's own template is a 400 naming it unless the operator trusts the clients."""
    body = {"model": served(stack), "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1,
            "chat_template": "{{ messages[0]['content'] }}"}
    refused = httpx2.post(f"{stack.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    trusting = HttpStack(loop, tokenizer, tiny_model_dir, trust_request_chat_template=True)
    try:
        trusting.wait_http_ready()
        usage = httpx2.post(f"{trusting.url}/v1/chat/completions", json=body).json()["usage"]
        assert usage["prompt_tokens"] == len(tokenizer.encode("hello there", add_special_tokens=False))
    finally:
        trusting.close()
