"""The official `openai` client against real engine + frontend processes (`--http-port`): completions and
chat, streaming and not, n > 1, batched prompts, stop strings, logprobs in both shapes, and a client that
goes away mid-stream (the engine's load must come back to zero). Greedy output must equal the gRPC API's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from frontend_svc.client import TandemClient, collect
from tests.e2e.conftest import Service, engine_service, free_port, frontend_service, wait_until

pytestmark = pytest.mark.slow

PROMPT_IDS = [5, 17, 42, 99, 7, 3]
CHAT = [{"role": "user", "content": "Say something about the sea."}]


class HttpSplit:
    def __init__(self, engine: Service, frontend: Service, http_port: int, model: str) -> None:
        self.engine, self.frontend, self.http_port, self.model = engine, frontend, http_port, model
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0,
                                    timeout=60)

    def load(self) -> epb.EngineLoad:
        with grpc.insecure_channel(self.engine.address) as channel:
            return epb_grpc.EngineCoreServiceStub(channel).GetLoad(epb.GetLoadRequest(), timeout=5)

    def grpc_text(self, **kwargs: Any) -> str:
        with TandemClient(self.frontend.address) as client:
            return str(collect(client.generate(timeout=60, **kwargs))[0]["text"])


@pytest.fixture(scope="module")
def split(make_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpSplit]:
    model = make_model("llama")
    logs = tmp_path_factory.mktemp("openai-e2e-logs")
    engine = engine_service(model, free_port(), logs)
    http_port = free_port()
    frontend = frontend_service(model, engine.port, free_port(), logs, "--http-port", str(http_port))
    engine.start()
    frontend.start()
    try:
        engine.wait_serving()
        frontend.wait_serving()
        wait_until(lambda: httpx2.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200, 30,
                   "/health 200")
        yield HttpSplit(engine, frontend, http_port, Path(model).name)
    finally:
        frontend.stop()
        engine.stop()


def test_completions_equal_the_grpc_api(split: HttpSplit) -> None:
    expected = split.grpc_text(token_ids=PROMPT_IDS, max_tokens=12, temperature=0.0)
    # n > 1 needs sampling (n identical greedy completions are refused, as vLLM): top_k=1 samples the argmax
    whole = split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=12, temperature=1,
                                            n=2, extra_body={"top_k": 1})
    assert [c.text for c in whole.choices] == [expected, expected] and [c.index for c in whole.choices] == [0, 1]
    assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (6, 24)
    streamed = {0: "", 1: ""}
    finishes = {}
    for chunk in split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=12,
                                                 temperature=1, n=2, stream=True, extra_body={"top_k": 1}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == {0: expected, 1: expected} and finishes == {0: "length", 1: "length"}


def test_batched_prompts_number_choices_by_prompt(split: HttpSplit) -> None:
    other = [9, 8, 7, 6]
    first = split.grpc_text(token_ids=PROMPT_IDS, max_tokens=6, temperature=0.0)
    second = split.grpc_text(token_ids=other, max_tokens=6, temperature=0.0)
    batch = split.client.completions.create(model=split.model, prompt=[PROMPT_IDS, other], max_tokens=6,
                                            temperature=1, n=2, extra_body={"top_k": 1})
    assert [(c.index, c.text) for c in batch.choices] == [(0, first), (1, first), (2, second), (3, second)]
    assert batch.usage is not None and batch.usage.prompt_tokens == len(PROMPT_IDS) + len(other)


def test_stop_strings_end_the_text_before_them(split: HttpSplit) -> None:
    full = split.grpc_text(token_ids=PROMPT_IDS, max_tokens=24, temperature=0.0)
    found = re.search(r"[A-Za-z]{2,3}", full[4:])
    assert found is not None, f"no visible stop string in {full!r}"
    stop = found.group()
    result = split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=24, temperature=0,
                                             stop=[stop, "never-there"])
    choice = result.choices[0]
    assert choice.text == full[: full.index(stop)] and choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra["stop_reason"] == stop


def test_chat_stream_with_usage_and_logprobs(split: HttpSplit) -> None:
    whole = split.client.chat.completions.create(model=split.model, messages=CHAT, max_completion_tokens=10,
                                                 temperature=0, logprobs=True, top_logprobs=2)
    content = whole.choices[0].message.content
    tokens = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert whole.usage is not None and len(tokens) == whole.usage.completion_tokens == 10  # type: ignore[arg-type]
    for token in tokens:  # type: ignore[union-attr]
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-5)  # greedy: the top one
    # vLLM's bytes: the UTF-8 of each token's text (a piece of a character: "" and no bytes)
    assert all(bytes(t.bytes or []) == t.token.encode() for t in tokens)  # type: ignore[union-attr]
    chunks = list(split.client.chat.completions.create(
        model=split.model, messages=CHAT, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_logprobs_shape(split: HttpSplit) -> None:
    result = split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=5, temperature=0,
                                             logprobs=3)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs or []) == len(logprobs.top_logprobs) == 5
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs):
        assert 1 <= len(top) <= 4 and token in top  # the top 3, plus the sampled token if it was not there
    assert (logprobs.text_offset or [])[0] == 0


def test_logit_bias_with_string_keys_equals_the_grpc_api(split: HttpSplit) -> None:
    """OpenAI's `logit_bias` (token ids as string keys) means what the gRPC API's does; +100 forces a token."""
    with TandemClient(split.frontend.address) as client:
        def grpc(**kwargs: Any) -> dict[str, Any]:
            return dict(collect(client.generate(timeout=60, **kwargs))[0])

        free = grpc(token_ids=PROMPT_IDS, temperature=0, max_tokens=8)["token_ids"]
        bias = {free[0]: -100.0, free[1]: -100.0}
        expected = grpc(token_ids=PROMPT_IDS, temperature=0, max_tokens=8, logit_bias=bias)
        forced = grpc(chat=CHAT, temperature=0.7, seed=1, max_tokens=5, logit_bias={42: 100.0})
    assert expected["token_ids"] != free and forced["token_ids"] == [42] * 5
    whole = split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=8, temperature=0,
                                            logit_bias={str(k): v for k, v in bias.items()})
    assert whole.choices[0].text == expected["text"]
    chat = split.client.chat.completions.create(model=split.model, messages=CHAT, max_completion_tokens=5,
                                                temperature=0.7, seed=1, logit_bias={"42": 100})
    assert chat.choices[0].message.content == forced["text"]  # the same five forced tokens, as text
    with pytest.raises(openai.BadRequestError) as info:
        split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=2,
                                        logit_bias={"99999999": 1.0})
    assert info.value.body["param"] == "logit_bias"  # type: ignore[index]


def test_allowed_token_ids_and_bad_words_equal_the_grpc_api(split: HttpSplit) -> None:
    """vLLM's token filters mean what the gRPC API's do (the sampler's semantics: tests/engine/test_sampler.py)
    and change the greedy output: the free output's first token is not in the allowed set."""
    with TandemClient(split.frontend.address) as client:
        def grpc(**kwargs: Any) -> dict[str, Any]:
            return dict(collect(client.generate(timeout=60, **kwargs))[0])

        free = grpc(token_ids=PROMPT_IDS, temperature=0, max_tokens=6)
        allowed = [t for t in range(20, 40) if t not in free["token_ids"]]
        only = grpc(token_ids=PROMPT_IDS, temperature=0, max_tokens=6, allowed_token_ids=allowed)
        word = free["text"].split()[0] if free["text"].split() else free["text"][:2]
        banned = grpc(token_ids=PROMPT_IDS, temperature=0, max_tokens=6, bad_words=[word])
    assert set(only["token_ids"]) <= set(allowed) and banned["token_ids"] != free["token_ids"]
    whole = split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                            extra_body={"allowed_token_ids": allowed})
    assert whole.choices[0].text == only["text"]
    whole = split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                            extra_body={"bad_words": [word]})
    assert whole.choices[0].text == banned["text"]


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(split: HttpSplit) -> None:
    for side, kept in (("left", PROMPT_IDS[-3:]), ("right", PROMPT_IDS[:3])):
        expected = split.grpc_text(token_ids=kept, max_tokens=4, temperature=0.0)
        result = split.client.completions.create(
            model=split.model, prompt=PROMPT_IDS, max_tokens=4, temperature=0,
            extra_body={"truncate_prompt_tokens": 3, "truncation_side": side})
        assert result.choices[0].text == expected
        assert result.usage is not None and result.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=2,
                                        extra_body={"truncate_prompt_tokens": 10**6})
    assert info.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_add_special_tokens_and_max_tokens_fitted_to_the_context(split: HttpSplit) -> None:
    """A text prompt gets the tokenizer's special tokens unless add_special_tokens is false; a max_tokens
    beyond what the context leaves generates to the end of the context, finish "length" (vLLM)."""
    with TandemClient(split.frontend.address) as client:
        with_special = client.tokenize("the sea")
        plain = client.tokenize("the sea", add_special_tokens=False)
    max_model_len = split.client.models.list().data[0].model_extra["max_model_len"]  # type: ignore[index]
    assert with_special != plain
    for flag, ids in ((True, with_special), (False, plain)):
        result = split.client.completions.create(model=split.model, prompt="the sea", max_tokens=1, temperature=0,
                                                 extra_body={"add_special_tokens": flag})
        assert result.usage is not None and result.usage.prompt_tokens == len(ids)
    prompt = [5] * (max_model_len - 3)
    result = split.client.completions.create(model=split.model, prompt=prompt, max_tokens=max_model_len,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        split.client.completions.create(model=split.model, prompt=prompt, max_tokens=max_model_len + 1)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_chat_echo_continue_final_message_and_request_id(split: HttpSplit) -> None:
    """continue_final_message leaves the assistant's message open (the gRPC API given the same rendered
    text generates the same); echo prepends that message, streamed or not; the body's request_id names
    the response when no X-Request-Id header is sent (vLLM)."""
    messages = [*CHAT, {"role": "assistant", "content": "The sea is"}]
    with TandemClient(split.frontend.address) as client:
        ids = client.tokenize(chat=messages, add_special_tokens=False)  # with the generation prompt
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True, "request_id": "sea-1"}
    whole = split.client.chat.completions.create(model=split.model, messages=messages, max_completion_tokens=5,
                                                 temperature=0, extra_body=extra)
    content = whole.choices[0].message.content or ""
    assert whole.id == "chatcmpl-sea-1" and content.startswith("The sea is")
    assert whole.usage is not None and whole.usage.prompt_tokens < len(ids)  # no generation prompt
    chunks = list(split.client.chat.completions.create(model=split.model, messages=messages,
                                                       max_completion_tokens=5, temperature=0, stream=True,
                                                       extra_body=extra))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    plain = split.client.chat.completions.create(model=split.model, messages=messages, max_completion_tokens=5,
                                                 temperature=0, extra_body={**extra, "echo": False})
    assert "The sea is" + (plain.choices[0].message.content or "") == content
    with pytest.raises(openai.BadRequestError) as info:
        split.client.chat.completions.create(model=split.model, messages=messages, max_completion_tokens=5,
                                             extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"  # type: ignore[index]


def test_refused_vllm_fields_are_400_naming_them(split: HttpSplit) -> None:
    for field, value in (("use_beam_search", True), ("suffix", "x")):
        with pytest.raises(openai.BadRequestError) as info:
            split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=2,
                                            extra_body={field: value})
        assert info.value.body["param"] == field, field  # type: ignore[index]
    # greedy: sampled (the default temperature 1, no seed), the two tokens come from the engine's global RNG,
    # whose position depends on the tests before and their timing; one of them samples EOS ("stop")
    ok = split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=2, temperature=0,
                                         extra_body={"use_beam_search": False, "suffix": None})
    assert ok.choices[0].finish_reason == "length"


def _grpc_prompt_logprobs(split: HttpSplit, **kwargs: Any) -> list[tuple[int, float]]:
    """The public gRPC API's prompt logprobs (token id, logprob) of positions 1.. of a request."""
    with TandemClient(split.frontend.address) as client:
        first = next(iter(client.generate(timeout=60, **kwargs)))
    return [(e.token_id, e.logprob) for e in first.prompt_logprobs]


def test_echo_with_logprobs_through_the_openai_client(split: HttpSplit) -> None:
    """lm-eval-harness's log-likelihood call: echo + logprobs, with and without generating (max_tokens 0:
    the prompt alone, one token generated and counted, as vLLM); the prompt's first token has no
    logprob; the prompt's logprobs are the gRPC API's prompt_logprobs; streaming gives the same text."""
    prompt = "the boats rocked"
    ids = split.client.completions.create(model=split.model, prompt=prompt, max_tokens=3, temperature=0,
                                          extra_body={"return_token_ids": True}).choices[0]
    generated = split.grpc_text(prompt=prompt, max_tokens=3, temperature=0.0)
    reference = _grpc_prompt_logprobs(split, prompt=prompt, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompt_ids = ids.model_extra["prompt_token_ids"]  # type: ignore[index]
    assert [t for t, _ in reference] == prompt_ids[1:]
    for max_tokens in (3, 0):
        result = split.client.completions.create(model=split.model, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, echo=True, logprobs=1)
        choice = result.choices[0]
        shown = len(prompt_ids) + max_tokens
        assert choice.text == prompt + (generated if max_tokens else "")
        assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == shown
        token_logprobs, top = choice.logprobs.token_logprobs or [], choice.logprobs.top_logprobs or []
        assert token_logprobs[0] is None and top[0] is None
        assert token_logprobs[1:len(prompt_ids)] == pytest.approx([lp for _, lp in reference], abs=1e-5)
        assert all(choice.logprobs.tokens[i] in top[i] and 1 <= len(top[i]) <= 2 for i in range(1, shown))
        assert result.usage is not None and result.usage.completion_tokens == max(max_tokens, 1)
        assert choice.finish_reason == "length"
        streamed = "".join(c.choices[0].text for c in split.client.completions.create(
            model=split.model, prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True, stream=True))
        assert streamed == choice.text


def test_prompt_logprobs_and_token_ids_on_both_apis(split: HttpSplit) -> None:
    """vLLM's prompt_logprobs ({token id: {logprob, rank, decoded_token}}, null first), return_token_ids
    (prompt_token_ids, token_ids) and return_tokens_as_token_ids ("token_id:N"), completions and chat,
    streamed and not; prompt_logprobs with stream is a 400 naming it."""
    extra = {"prompt_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    result = split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=4, temperature=0,
                                             logprobs=1, extra_body=extra)
    choice = result.choices[0].model_extra or {}
    assert choice["prompt_token_ids"] == PROMPT_IDS and len(choice["token_ids"]) == 4
    reference = _grpc_prompt_logprobs(split, token_ids=PROMPT_IDS, max_tokens=1, temperature=0.0, prompt_logprobs=2)
    positions = choice["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(PROMPT_IDS)
    for position, token, (ref_id, ref_lp) in zip(positions[1:], PROMPT_IDS[1:], reference):
        assert ref_id == token and position[str(token)]["logprob"] == pytest.approx(ref_lp, abs=1e-5)
        assert 2 <= len(position) <= 3 and {e["rank"] for e in position.values()} >= {1, 2}
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == [f"token_id:{t}" for t in choice["token_ids"]]
    assert (result.system_fingerprint or "").startswith("tandem-")
    streamed: list[int] = []
    for chunk in split.client.completions.create(model=split.model, prompt=PROMPT_IDS, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}):
        for c in chunk.choices:
            streamed += (c.model_extra or {})["token_ids"]
    assert streamed == choice["token_ids"]

    chat = split.client.chat.completions.create(model=split.model, messages=CHAT, max_tokens=4, temperature=0,
                                                extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    body = chat.model_extra or {}
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(body["prompt_token_ids"])
    chat_ids = (chat.choices[0].model_extra or {})["token_ids"]
    assert len(chat_ids) == 4
    firsts, stream_ids = [], []
    for chunk in split.client.chat.completions.create(model=split.model, messages=CHAT, max_tokens=4,
                                                      temperature=0, stream=True,
                                                      extra_body={"return_token_ids": True}):
        firsts.append((chunk.model_extra or {}).get("prompt_token_ids"))
        for c in chunk.choices:
            stream_ids += (c.model_extra or {}).get("token_ids") or []
    assert firsts[0] == body["prompt_token_ids"] and not any(firsts[1:]) and stream_ids == chat_ids
    for api, call in (("completions", lambda **kw: split.client.completions.create(prompt=PROMPT_IDS, **kw)),
                      ("chat", lambda **kw: split.client.chat.completions.create(messages=CHAT, **kw))):
        with pytest.raises(openai.BadRequestError) as info:
            call(model=split.model, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})
        assert info.value.body["param"] == "prompt_logprobs", api  # type: ignore[index]


def test_cancel_mid_stream_brings_engine_load_back_to_zero(split: HttpSplit) -> None:
    # Both completions must still run when the load is read: without ignore_eos the first sampled EOS after
    # ~250 tokens, and a suite run on a busy box read the load after the engine had got that far. 2,000
    # tokens each (the context is 2,048; the prompt 26) is seconds of runway on this engine.
    stream = split.client.chat.completions.create(model=split.model, messages=CHAT, max_tokens=2000, n=2,
                                                  temperature=0.8, seed=1, stream=True,
                                                  extra_body={"ignore_eos": True})
    for received, _ in enumerate(stream, 1):
        if received == 6:
            break
    load = split.load()
    assert load.num_running + load.num_waiting == 2, load
    stream.close()
    wait_until(lambda: (lambda lo: lo.num_running == 0 and lo.num_waiting == 0)(split.load()), 10,
               "engine load back to zero")
