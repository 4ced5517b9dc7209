"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the fake engine over real
sockets, with the official `anthropic` client: the same prompt and sampling as the chat completion it maps
to, the body and Anthropic's stream events, tool calls (parsed by the server's --tool-call-parser, or
engine-constrained for tool_choice any / tool) as tool_use blocks, count_tokens equal to the prompt the
engine gets, refusals by name in Anthropic's error shape, API keys by either header, and the bounds every
generation route has (admission, disconnect -> abort, draining, a big or bad body never stalls another
stream). The real model against vLLM's recorded answers: tests/realmodel/test_messages_served.py.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from frontend_svc.anthropic import convert
from frontend_svc.anthropic import protocol as ap
from frontend_svc.anthropic.answer import MessageBuilder
from frontend_svc.openai.tool_parsers import ToolEvent
from frontend_svc.openai.tools import ToolCalls
from frontend_svc.outputs import CompletionDelta
from tests.fake_engine import SEED_FAIL_LATE
from tests.openai_api.conftest import HttpStack, SseReader
from tests.support import MAX_STALL_S, LoopThread, wait_until

CONTEXT = 4096
KEY = "sk-messages-test"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
MESSAGE = [{"role": "user", "content": "Hi"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    stack = HttpStack(loop, tokenizer, tiny_model_dir, max_model_len=CONTEXT, max_concurrent_requests=4,
                      step_s=0.01, tool_call_parser="hermes")
    stack.wait_http_ready()
    yield stack
    stack.close()


@pytest.fixture
def scripted(stack: HttpStack, tokenizer: Any) -> Iterator[Any]:
    """`scripted(text)`: the fake engine answers with `text`'s tokens, then EOS (and stops there)."""

    def script(text: str) -> list[int]:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        stack.fake.output_ids = [*ids, tokenizer.eos_token_ids[0]]
        stack.fake.stop_on_eos = True
        return ids

    yield script
    stack.fake.output_ids, stack.fake.stop_on_eos = None, False


def client(stack: HttpStack, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key=kwargs.pop("api_key", "none"), max_retries=0, timeout=30,
                               **kwargs)


def served(stack: HttpStack) -> str:
    return str(stack.frontend.config.model_name)


def post(stack: HttpStack, body: dict[str, Any], path: str = "/v1/messages", **kwargs: Any) -> httpx2.Response:
    return httpx2.post(f"{stack.url}{path}", json={"model": served(stack), **body}, timeout=30, **kwargs)


def last_prompt(stack: HttpStack, send: Any) -> tuple[Any, list[int], Any]:
    """What `send()` returned, the prompt token ids the engine got for it, and the engine request."""
    before = len(stack.fake.added)
    out = send()
    added = stack.fake.added[before]
    return out, list(added.prompt_token_ids), added


def error_of(response: httpx2.Response, status: int) -> dict[str, Any]:
    """The Anthropic error of a refusal (`{"type": "error", "error": {"type", "message"}}`)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    error: dict[str, Any] = body["error"]
    return error


def sse(raw: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.strip().split("\n\n"):
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        out.append((event[7:], json.loads(data[6:])))
    return out


def test_a_message_is_the_chat_completion_of_the_same_messages(stack: HttpStack) -> None:
    """System + blocks + multi-turn render as chat's messages; temperature/top_k as extra body fields (SDK 2.x)."""
    c = client(stack)
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
                     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More"}]
    answer, prompt, added = last_prompt(stack, lambda: c.messages.create(
        model=served(stack), system="Be brief.", messages=messages, max_tokens=6, extra_body={"temperature": 0}))
    chat_messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"},
                     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More"}]
    chat, chat_prompt, _ = last_prompt(stack, lambda: httpx2.post(f"{stack.url}/v1/chat/completions", json={
        "messages": chat_messages, "max_tokens": 6, "temperature": 0}, timeout=30).json())
    assert prompt == chat_prompt and added.sampling_params.temperature == 0
    [block] = answer.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"] and block.text
    assert answer.id.startswith("msg_") and answer.type == "message" and answer.role == "assistant"
    assert answer.model == served(stack) and answer.stop_reason == "max_tokens" and answer.stop_sequence is None
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (len(prompt), 6)


def test_streaming_sends_anthropics_events_in_order(stack: HttpStack) -> None:
    c = client(stack)
    body: Any = {"model": served(stack), "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5}
    with c.messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert kinds[:2] == ["message_start", "content_block_start"] and len(deltas) > 1
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start, stop = events[0], events[-2]
    assert start.message.content == [] and start.message.usage.output_tokens == 0  # type: ignore[union-attr]
    assert stop.delta.stop_reason == "max_tokens" and stop.usage.output_tokens == 5  # type: ignore[union-attr]
    whole = c.messages.create(**body)
    assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens == start.message.usage.input_tokens  # type: ignore[union-attr]


def test_the_raw_stream_is_event_and_data_lines_without_done(stack: HttpStack) -> None:
    with httpx2.stream("POST", f"{stack.url}/v1/messages", json={
            "model": served(stack), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "stream": True}, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = sse(raw)
    assert all(data["type"] == name for name, data in events) and "[DONE]" not in raw
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert [i for name, data in events if (i := data.get("index")) is not None] == [0] * (len(events) - 3)


def test_stop_sequences_stop_with_stop_sequence(stack: HttpStack, scripted: Any) -> None:
    scripted("The weather is fine today.")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "stop_sequences": ["fine"]}
    whole = post(stack, body).json()
    assert whole["content"] == [{"type": "text", "text": "The weather is "}]
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "fine")
    with httpx2.stream("POST", f"{stack.url}/v1/messages", json={"model": served(stack), **body, "stream": True},
                       timeout=30) as response:
        events = sse(response.read().decode())
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == "The weather is "
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "fine"}


def test_an_auto_tool_call_is_a_tool_use_block(stack: HttpStack, scripted: Any) -> None:
    """The hermes parser takes the call out of the text: text block, then tool_use, stop_reason tool_use;
    streamed, input_json_delta pieces reassemble to the same input."""
    scripted("Let me check." + CALL)
    c = client(stack)
    body: Any = {"model": served(stack), "messages": [{"role": "user", "content": "Weather in Paris?"}],
                 "max_tokens": 200, "tools": [WEATHER]}
    whole = c.messages.create(**body)
    assert [b.type for b in whole.content] == ["text", "tool_use"] and whole.stop_reason == "tool_use"
    text, use = whole.content
    assert text.text == "Let me check." and use.name == "get_weather" and use.input == {"city": "Paris"}  # type: ignore[union-attr]
    with c.messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"  # type: ignore[union-attr]
              and e.delta.type == "input_json_delta"]
    assert json.loads("".join(pieces)) == {"city": "Paris"} and len(pieces) > 1
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[1].input == {"city": "Paris"} and final.content[1].id.startswith("chatcmpl-tool-")  # type: ignore[union-attr]
    starts = [e.index for e in events if e.type == "content_block_start"]  # type: ignore[union-attr]
    assert starts == [0, 1]


def test_a_complete_call_wins_over_a_stop_sequence_after_it(stack: HttpStack, scripted: Any) -> None:
    """vLLM's rule: a stop string that ends the text after a complete call does not make it a stop_sequence
    answer (the call may run); before the call completes it would (the forced-call test)."""
    scripted(CALL + " all done")
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200, "tools": [WEATHER],
            "stop_sequences": ["done"]}
    answer = post(stack, body).json()
    assert [b["type"] for b in answer["content"]] == ["tool_use"] and answer["stop_reason"] == "tool_use"
    assert "stop_sequence" not in answer
    with httpx2.stream("POST", f"{stack.url}/v1/messages", json={"model": served(stack), **body, "stream": True},
                       timeout=30) as response:
        events = sse(response.read().decode())
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_text_after_a_call_comes_as_a_block_after_it_when_streamed() -> None:
    """vLLM's order: content the parser gives while a tool_use block is open waits for that block to close."""
    class Parser:  # a call in the first delta, content in the second
        def feed(self, text: str) -> list[Any]:
            if text == "call":
                return [ToolEvent("name", "f", 0), ToolEvent("args", "{}", 0)]
            return [ToolEvent("content", text)]

        def finish(self) -> list[Any]:
            return []

    builder = MessageBuilder("msg_x", "m", lambda: ToolCalls(Parser(), True))
    raw = (builder.events(CompletionDelta("r", 0, "call", [1])) + builder.events(CompletionDelta("r", 0, "after", [2]))
           + builder.events(CompletionDelta("r", 0, "", [], finish_reason="stop")) + builder.closing())
    events = sse(raw)
    assert [(n, d.get("index")) for n, d in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("message_delta", None), ("message_stop", None)]
    assert events[4][1]["delta"] == {"type": "text_delta", "text": "after"}
    assert events[6][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_maps_to_the_chat_paths_constraints(stack: HttpStack) -> None:
    """tool -> the tool's input schema as the engine constraint; any -> vLLM's array of calls (one with
    disable_parallel_tool_use); none -> no constraint, no parsing."""
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tools": [WEATHER]}
    _, _, named = last_prompt(stack, lambda: post(stack, {**base, "tool_choice": {"type": "tool", "name": "get_weather"}}))
    assert json.loads(named.sampling_params.structured_outputs.json) == WEATHER["input_schema"]
    _, _, any_ = last_prompt(stack, lambda: post(stack, {**base, "tool_choice": {"type": "any"}}))
    schema = json.loads(any_.sampling_params.structured_outputs.json)
    assert schema["type"] == "array" and "maxItems" not in schema
    _, _, one = last_prompt(stack, lambda: post(stack, {**base, "tool_choice": {
        "type": "any", "disable_parallel_tool_use": True}}))
    assert json.loads(one.sampling_params.structured_outputs.json)["maxItems"] == 1
    none, _, plain = last_prompt(stack, lambda: post(stack, {**base, "tool_choice": {"type": "none"}}))
    assert not plain.sampling_params.HasField("structured_outputs") and none.json()["content"][0]["type"] == "text"


def test_a_forced_call_is_a_tool_use_block_with_the_constrained_input(stack: HttpStack, scripted: Any) -> None:
    """Complete arguments: tool_use with them as input, stop_reason tool_use; cut by a stop sequence or by
    max_tokens: input {} and the cut's stop_reason (vLLM: max_tokens wins; a stop string wins over a call
    whose arguments are not complete JSON)."""
    forced = {"messages": MESSAGE, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    ids = scripted('{"city": "Rome"}')
    for extra, stop_reason, tool_input in (({"max_tokens": 50}, "tool_use", {"city": "Rome"}),
                                           ({"max_tokens": 50, "stop_sequences": ["}"]}, "stop_sequence", {}),
                                           ({"max_tokens": len(ids) - 1}, "max_tokens", {})):
        answer = post(stack, {**forced, **extra}).json()
        [use] = answer["content"]
        assert (use["type"], use["name"], use["input"]) == ("tool_use", "get_weather", tool_input), answer
        assert answer["stop_reason"] == stop_reason


def test_tool_use_and_tool_result_turns_render_as_chats_tool_messages(stack: HttpStack) -> None:
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": [{"type": "text", "text": "Sunny"}, {"type": "text", "text": "21 C"}]},
                                          {"type": "text", "text": "Thanks"}]}]
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny\n21 C"}, {"role": "user", "content": "Thanks"}]
    _, prompt, _ = last_prompt(stack, lambda: post(stack, {"messages": turns, "max_tokens": 2, "tools": [WEATHER],
                                                           "tool_choice": {"type": "none"}}))
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    _, chat_prompt, _ = last_prompt(stack, lambda: httpx2.post(f"{stack.url}/v1/chat/completions", json={
        "messages": chat, "max_tokens": 2, "tools": tools, "tool_choice": "none"}, timeout=30))
    assert prompt == chat_prompt


def test_count_tokens_is_the_length_of_the_prompt_the_engine_gets(stack: HttpStack) -> None:
    c = client(stack)
    for extra in ({}, {"system": [{"type": "text", "text": "Be brief."}]}, {"tools": [WEATHER]}):
        body: Any = {"model": served(stack), "messages": [{"role": "user", "content": "Hello there"}], **extra}
        _, prompt, _ = last_prompt(stack, lambda: c.messages.create(max_tokens=1, **body))  # noqa: B023
        counted = c.messages.count_tokens(**body)
        assert counted.input_tokens == len(prompt)
        raw = post(stack, body, "/v1/messages/count_tokens").json()
        assert raw == {"input_tokens": len(prompt), "context_management": {"original_input_tokens": len(prompt)}}
    error = error_of(post(stack, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                          "/v1/messages/count_tokens"), 400)
    assert error["message"].startswith("max_tokens:")


def test_sampling_fields_reach_the_engine(stack: HttpStack) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9,
            "top_k": 7, "stop_sequences": ["zz", "yy"], "metadata": {"user_id": "u"}, "service_tier": "auto",
            "cache_control": {"type": "ephemeral"}, "thinking": {"type": "disabled"},
            "output_config": {"effort": "low"}}
    answer, _, sent = last_prompt(stack, lambda: post(stack, body))
    sp = sent.sampling_params
    assert answer.status_code == 200, answer.text
    assert (sp.max_tokens, sp.top_k, [round(sp.temperature, 3), round(sp.top_p, 3)]) == (3, 7, [0.5, 0.9])


def test_output_config_format_constrains_the_output(stack: HttpStack) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer, _, sent = last_prompt(stack, lambda: post(stack, {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "output_config": {"format": {"type": "json_schema", "schema": schema}}}))
    assert answer.status_code == 200, answer.text
    assert json.loads(sent.sampling_params.structured_outputs.json) == schema


@pytest.mark.parametrize(("body", "field"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"container": "c"}, "container"), ({"cache_salt": "salt"}, "cache_salt"), ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ({"speed": "fast"}, "speed"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "messages.[0].content.[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.[0].content.[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.[0].content.[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{"x": 1}]}]}]},
     "messages.[0].content.[0].citations"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages.[0].content.[0].content.[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "t", "signature": "s"}]}]},
     "messages.[0].content.[0].type"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools.[0].defer_loading"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": CONTEXT + 1}, "max_tokens"), ({"stop_sequences": ["s"] * 100}, "stop_sequences"),
    ({"messages": []}, "messages"),
])
def test_bad_or_unsupported_input_is_400_naming_the_field(stack: HttpStack, body: dict[str, Any], field: str) -> None:
    error = error_of(post(stack, {"messages": MESSAGE, "max_tokens": 2, **body}), 400)
    assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{field}:"), error


def test_the_sdk_raises_its_own_errors(stack: HttpStack) -> None:
    c = client(stack)
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model=served(stack), messages=MESSAGE, max_tokens=2, extra_body={"top_k": -5})
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="claude-sonnet-4-5", messages=MESSAGE, max_tokens=2)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_api_keys_by_either_header(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> None:
    """Anthropic's SDK sends X-Api-Key; Authorization: Bearer works too; a refusal is Anthropic's 401."""
    keyed = HttpStack(loop, tokenizer, tiny_model_dir, api_keys=(KEY,))
    try:
        keyed.wait_http_ready()
        assert client(keyed, api_key=KEY).messages.create(model=served(keyed), messages=MESSAGE, max_tokens=1).content
        assert post(keyed, {"messages": MESSAGE, "max_tokens": 1},
                    headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        with pytest.raises(anthropic.AuthenticationError) as refused:
            client(keyed, api_key="wrong").messages.create(model=served(keyed), messages=MESSAGE, max_tokens=1)
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        assert error_of(post(keyed, {"messages": MESSAGE}, "/v1/messages/count_tokens"), 401)
        assert httpx2.get(f"{keyed.url}/v1/models", headers={"X-Api-Key": KEY}, timeout=10).status_code == 200
    finally:
        keyed.close()


def test_an_engine_failure_mid_stream_is_an_error_event(stack: HttpStack) -> None:
    """SEED_FAIL_LATE fails after two tokens (the fake engine reads the sampling seed, which Messages has no
    field for: the test sets it through the chat request the route builds)."""
    original = convert.to_chat

    def with_seed(body: Any) -> Any:
        chat = original(body)
        chat.seed = SEED_FAIL_LATE
        return chat

    convert.to_chat = with_seed  # type: ignore[assignment]
    try:
        with httpx2.stream("POST", f"{stack.url}/v1/messages", json={
                "model": served(stack), "messages": MESSAGE, "max_tokens": 50, "stream": True}, timeout=30) as response:
            events = sse(response.read().decode())
    finally:
        convert.to_chat = original  # type: ignore[assignment]
    name, data = events[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "overloaded_error"
    assert "message_stop" not in [n for n, _ in events]
    stack.wait_engine_idle()


def test_disconnect_mid_stream_aborts_the_request_in_the_engine(stack: HttpStack) -> None:
    reader = SseReader(f"{stack.url}/v1/messages", {"model": served(stack), "messages": MESSAGE, "stream": True,
                                                    "max_tokens": 2000})
    reader.wait_started()
    rid = next(iter(stack.fake.running))
    reader.stop()
    stack.wait_engine_idle(timeout=5)
    assert rid in stack.fake.aborted


def test_admission_and_draining_answer_in_anthropics_shape(stack: HttpStack) -> None:
    busy = [SseReader(f"{stack.url}/v1/messages", {"model": served(stack), "messages": MESSAGE, "stream": True,
                                                   "max_tokens": 2000}) for _ in range(4)]
    try:
        for reader in busy:
            reader.wait_started()
        response = post(stack, {"messages": MESSAGE, "max_tokens": 2})
        assert error_of(response, 429)["type"] == "rate_limit_error" and response.headers["retry-after"] == "1"
    finally:
        for reader in busy:
            reader.stop()
    stack.wait_engine_idle()
    stack.frontend.draining = True
    try:
        assert error_of(post(stack, {"messages": MESSAGE, "max_tokens": 2}), 503)["type"] == "overloaded_error"
    finally:
        stack.frontend.draining = False
    wait_until(lambda: post(stack, {"messages": MESSAGE, "max_tokens": 2}).status_code == 200, 10, "serving again")


def test_big_and_bad_bodies_never_stall_another_stream(stack: HttpStack) -> None:
    """A 3.9 MB message (parsed on a thread, tokenized on the pool, then too long for the context), a body over
    the limit (413) and refused fields while a victim stream runs: its gaps stay under MAX_STALL_S."""
    limit = stack.frontend.config.max_message_bytes
    victim = SseReader(f"{stack.url}/v1/messages", {"model": served(stack), "messages": MESSAGE, "stream": True,
                                                    "max_tokens": 3000})
    try:
        victim.wait_started()
        for body, status in (({"messages": [{"role": "user", "content": "The quick brown fox. " * (3_900_000 // 21)}],
                               "max_tokens": 2}, 400),
                             ({"messages": [{"role": "user", "content": "x" * (limit + 10)}], "max_tokens": 2}, 413),
                             ({"messages": MESSAGE, "max_tokens": 2, "container": "c"}, 400)):
            answer, gap = victim.during(f"messages body {status}", functools.partial(post, stack, body))
            assert answer.status_code == status and answer.json()["type"] == "error"
            assert gap < MAX_STALL_S
    finally:
        victim.stop()
    assert victim.error is None
    stack.wait_engine_idle()


def test_an_empty_answer_is_one_empty_text_block_or_no_streamed_block(stack: HttpStack, scripted: Any) -> None:
    """vLLM's shapes for no text: one empty text block; streamed, no content block at all."""
    ids = scripted("abc")
    body = {"messages": MESSAGE, "max_tokens": 5, "stop_sequences": ["a"]}
    whole = post(stack, body).json()
    assert whole["content"] == [{"type": "text", "text": ""}] and whole["stop_reason"] == "stop_sequence"
    with httpx2.stream("POST", f"{stack.url}/v1/messages", json={"model": served(stack), **body, "stream": True},
                       timeout=30) as response:
        events = sse(response.read().decode())
    assert [n for n, _ in events] == ["message_start", "message_delta", "message_stop"] and ids


def test_to_chat_maps_every_honoured_field() -> None:
    body = ap.MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "A"},
                                                   {"type": "text", "text": "x-anthropic-billing-header: 1"},
                                                   {"type": "text", "text": "B"}],
        "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "inline"}],
        "stop_sequences": ["s"], "temperature": 0.2, "top_p": 0.5, "top_k": 3, "chat_template_kwargs": {"a": 1},
        "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {"type": "object"}}},
        "tools": [{"name": "f", "input_schema": {"properties": {}}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})
    chat = convert.to_chat(body)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "AB"}, {"role": "user", "content": "Hi"}, {"role": "system", "content": "inline"}]
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k) == (9, ["s"], 0.2, 0.5, 3)
    assert chat.chat_template_kwargs == {"a": 1, "reasoning_effort": "high", "enable_thinking": True}
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.tools is not None and chat.tools[0].function.parameters == {"type": "object", "properties": {}}
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is False
