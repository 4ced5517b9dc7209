"""vLLM's `stream_interval` on /v1/completions and /v1/chat/completions, in front of the fake engine:
streamed chunks carry the first token alone, then at least `stream_interval` tokens each (the server's
`--stream-interval` is the floor), and the stream adds up to what interval 1 streams; 0 is a 400 naming
the field; a non-streaming response is unchanged. Chunk sizes are read from `return_token_ids`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.openai_api.conftest import HttpStack
from tests.support import LoopThread

PROMPT_IDS = list(range(5, 45))  # the fake engine echoes the prompt back: '!"#$%&...0123456789:;<=>...'
MESSAGES = [{"role": "user", "content": "the boats rocked against their ropes while a radio played below deck"}]


@pytest.fixture(scope="module")
def stacks(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[tuple[HttpStack, HttpStack]]:
    """(the default server, one with --stream-interval 3)."""
    plain = HttpStack(loop, tokenizer, tiny_model_dir, step_s=0.01)
    floor = HttpStack(loop, tokenizer, tiny_model_dir, step_s=0.01, stream_interval=3)
    plain.wait_http_ready()
    floor.wait_http_ready()
    yield plain, floor
    plain.close()
    floor.close()


def client(stack: HttpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=30)


def streamed(stack: HttpStack, chat: bool, interval: int | None, **kwargs: Any) -> dict[int, dict[str, Any]]:
    """Per choice index: its chunks' token counts, text, ids, logprob tokens, finish and stop reasons;
    and the usage (index -1)."""
    extra = {"return_token_ids": True, **({"stream_interval": interval} if interval is not None else {})}
    common = dict(model=stack.frontend.config.model_name, max_tokens=30, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra, **kwargs)
    c = client(stack)
    if chat:
        chunks = c.chat.completions.create(messages=MESSAGES, **common)
    else:
        chunks = c.completions.create(prompt=PROMPT_IDS, **common)
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        if chunk.usage is not None:
            out[-1] = {"usage": chunk.usage.model_dump()}
        for choice in chunk.choices:
            ids = getattr(choice, "token_ids", None) or []
            seen = out.setdefault(choice.index, {"sizes": [], "text": "", "ids": [], "lp": [], "finish": None})
            if ids:
                seen["sizes"].append(len(ids))
            seen["ids"] += ids
            seen["text"] += (choice.delta.content or "") if chat else choice.text
            if choice.logprobs is not None:
                seen["lp"] += [e.token for e in choice.logprobs.content] if chat else choice.logprobs.tokens
            if choice.finish_reason is not None:
                seen["finish"] = (choice.finish_reason, getattr(choice, "stop_reason", None))
    return out


def whole(result: dict[int, dict[str, Any]]) -> dict[int, Any]:
    """What a client ends up with (everything but the chunking)."""
    return {i: {k: v for k, v in r.items() if k != "sizes"} for i, r in result.items()}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("case", ["plain", "stop-logprobs-n2"])
def test_chunks_hold_the_interval_and_add_up_to_interval_1(stacks: tuple[HttpStack, HttpStack], chat: bool,
                                                           case: str) -> None:
    plain, _ = stacks
    kwargs: dict[str, Any] = {}
    if case != "plain":
        kwargs = dict(n=2, stop=["rock" if chat else "789"], logprobs=True if chat else 2, temperature=1.0)
        if chat:
            kwargs["top_logprobs"] = 2
    expected = streamed(plain, chat, None, **kwargs)
    got = streamed(plain, chat, 4, **kwargs)
    assert whole(got) == whole(expected)
    choices = [i for i in got if i >= 0]
    assert len(choices) == kwargs.get("n", 1)
    for index in choices:
        sizes = got[index]["sizes"]
        assert sizes[0] == 1 and all(s >= 4 for s in sizes[1:-1]) and len(sizes) >= 3, sizes
        assert len(expected[index]["sizes"]) > len(sizes)
    assert got[-1]["usage"]["completion_tokens"] == sum(len(got[i]["ids"]) for i in choices)
    if case != "plain":
        assert {got[i]["finish"] for i in choices} == {("stop", kwargs["stop"][0])}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_servers_interval_is_the_floor(stacks: tuple[HttpStack, HttpStack], chat: bool) -> None:
    plain, floor = stacks
    expected = whole(streamed(plain, chat, None))
    for request, least in [(None, 3), (2, 3), (1, 3), (6, 6)]:
        got = streamed(floor, chat, request)
        sizes = got[0]["sizes"]
        assert sizes[0] == 1 and all(s >= least for s in sizes[1:-1]) and len(sizes) >= 3, (request, sizes)
        assert whole(got) == expected


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("value", [0, -2, "x"])
def test_a_bad_value_is_400_naming_the_field(stacks: tuple[HttpStack, HttpStack], chat: bool, value: Any) -> None:
    c, model = client(stacks[0]), stacks[0].frontend.config.model_name
    for stream in (True, False):
        with pytest.raises(openai.BadRequestError) as info:
            if chat:
                c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3,
                                          stream=stream, extra_body={"stream_interval": value})
            else:
                c.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=3, stream=stream,
                                     extra_body={"stream_interval": value})
        assert info.value.body["param"] == "stream_interval", info.value.body  # type: ignore[index]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_non_streaming_response_is_unchanged(stacks: tuple[HttpStack, HttpStack], chat: bool) -> None:
    c, model = client(stacks[1]), stacks[1].frontend.config.model_name
    common = dict(model=model, max_tokens=25, n=2, temperature=1.0, extra_body={"return_token_ids": True})

    def ask(interval: int | None) -> Any:
        extra = {**common["extra_body"], **({"stream_interval": interval} if interval else {})}  # type: ignore[dict-item]
        args = {**common, "extra_body": extra}
        if chat:
            response = c.chat.completions.create(messages=MESSAGES, logprobs=True,
                                                 top_logprobs=1, **args)
        else:
            response = c.completions.create(prompt=PROMPT_IDS, logprobs=1, **args)
        body = response.model_dump()
        return body["choices"], body["usage"]

    assert ask(7) == ask(None) == ask(1)
