"""Tool calls out of generated text (frontend_svc/openai/tool_parsers.py, tools.py), without a model:
the Hermes and "required" parsers give the same calls whatever way the text is split into deltas (a
stream reassembles to the non-streaming answer), content is what precedes the first call, and the
engine constraints of named / required tool choices are vLLM's schemas."""

from __future__ import annotations

import json
import random

import pytest

from frontend_svc.openai import protocol as p
from frontend_svc.openai.tool_parsers import HermesParser, RequiredParser
from frontend_svc.openai.tools import ToolCalls, constraint, tool_calls_factory

HERMES = ('I will look that up. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",\n'
          '  "days": [1, 2], "unit": "c\\"x"}}\n</tool_call>\n<tool_call>{"name":"get_time","arguments":{}}'
          '</tool_call>')
HERMES_CALLS = [("get_weather", '{"city": "Paris", "days": [1, 2], "unit": "c\\"x"}'), ("get_time", "{}")]
REQUIRED = '[ {"name": "get_weather", "parameters": {"city":"Oslo","n":3.5}} ,{"name":"get_time","parameters":{}}]'
REQUIRED_CALLS = [("get_weather", '{"city": "Oslo", "n": 3.5}'), ("get_time", "{}")]


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 3)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def run(make, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[p.DeltaMessage]]:
    calls = ToolCalls(make(), finish_as_tool_calls=True)
    deltas = [calls.delta(piece, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return "".join(calls.content) or None, [(c.function.name, c.function.arguments) for c in calls.calls], deltas


@pytest.mark.parametrize(("make", "text", "content", "want"), [
    (HermesParser, HERMES, "I will look that up. ", HERMES_CALLS),
    (RequiredParser, REQUIRED, None, REQUIRED_CALLS),
])
def test_any_split_into_deltas_gives_the_whole_texts_calls(make, text, content, want) -> None:
    whole = run(make, [text])
    assert whole[:2] == (content, want)
    for json_args in (a for _, a in want):
        json.loads(json_args)
    for seed in range(30):
        pieces = splits(text, seed)
        got_content, got_calls, deltas = run(make, pieces)
        assert (got_content, got_calls) == (content, want), pieces
        # the deltas alone (what a client sees) reassemble to the calls: id + name first, then arguments
        joined: dict[int, list[str]] = {}
        for delta in deltas:
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index not in joined and piece.function.name
                    joined[piece.index] = [piece.function.name, ""]
                joined[piece.index][1] += piece.function.arguments or ""
        assert [tuple(joined[i]) for i in sorted(joined)] == want
    assert run(make, list(text))[:2] == (content, want)  # one character at a time


def test_hermes_text_without_calls_is_content_even_with_a_held_back_tag_prefix() -> None:
    assert run(HermesParser, ["Just text <tool", "_ca"])[:2] == ("Just text <tool_ca", [])
    assert run(HermesParser, ["a < b"])[:2] == ("a < b", [])


def test_hermes_skips_a_malformed_call_and_keeps_the_next() -> None:
    text = '<tool_call>not json</tool_call><tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert run(HermesParser, [text])[:2] == (None, [("f", '{"a": 1}')])


def tool(name: str, parameters: dict | None) -> p.Tool:
    return p.Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


def chat(**fields) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_named_and_required_tool_choices_are_vllms_schemas() -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [tool("a", params).model_dump(), tool("b", None).model_dump()]
    named = constraint(chat(tools=tools, tool_choice={"type": "function", "function": {"name": "a"}}))
    assert named is not None and json.loads(named.json) == params
    required = constraint(chat(tools=tools, tool_choice="required"))
    assert required is not None
    schema = json.loads(required.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == params
    one = constraint(chat(tools=tools, tool_choice="required", parallel_tool_calls=False))
    assert one is not None and json.loads(one.json)["maxItems"] == 1
    assert constraint(chat(tools=tools, tool_choice="auto")) is None
    assert constraint(chat(tools=tools, tool_choice="none")) is None


def test_auto_without_parallel_tool_calls_keeps_the_first_call() -> None:
    tools = [tool("get_weather", None).model_dump(), tool("get_time", None).model_dump()]
    for parallel, want in ((True, HERMES_CALLS), (False, HERMES_CALLS[:1])):
        make = tool_calls_factory(chat(tools=tools, tool_choice="auto", parallel_tool_calls=parallel), "hermes")
        assert make is not None
        for pieces in ([HERMES], splits(HERMES, 1)):
            calls = make()
            deltas = [calls.delta(piece, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
            assert [(c.function.name, c.function.arguments) for c in calls.calls] == want
            assert {d.index for delta in deltas for d in delta.tool_calls or []} == set(range(len(want)))
