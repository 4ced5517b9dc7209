"""The Responses API (`POST /v1/responses`, GET/cancel) on the fake engine over real sockets, with the
official `openai` client: the same prompt and sampling as the chat completion it maps to, the answer's
shape and vLLM's streaming events, refusals by name, the 404s of a server that stores nothing, and the
bounds every generation route has (admission, disconnect -> abort, 503 while draining, a big body never
stalls another stream). The real model against vLLM's recorded answers: tests/realmodel/test_responses_served.py.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from frontend_svc.openai import responses
from frontend_svc.openai import responses_protocol as rp
from tests.fake_engine import SEED_FAIL_LATE
from tests.openai_api.conftest import HttpStack, SseReader
from tests.support import MAX_STALL_S, LoopThread, wait_until

CONTEXT = 4096
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
          "response.output_text.delta", "response.output_text.done", "response.content_part.done",
          "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    stack = HttpStack(loop, tokenizer, tiny_model_dir, max_model_len=CONTEXT, max_concurrent_requests=4,
                      step_s=0.01)
    stack.wait_http_ready()
    yield stack
    stack.close()


def client(stack: HttpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=30)


def served(stack: HttpStack) -> str:
    return str(stack.frontend.config.model_name)


def post(stack: HttpStack, body: dict[str, Any], path: str = "/v1/responses") -> httpx2.Response:
    return httpx2.post(f"{stack.url}{path}", json=body, timeout=30)


def last_prompt(stack: HttpStack, send: Any) -> tuple[Any, list[int]]:
    """What `send()` returned and the prompt token ids the engine got for it."""
    before = len(stack.fake.added)
    out = send()
    return out, list(stack.fake.added[before].prompt_token_ids)


def error_of(response: httpx2.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_a_response_is_the_chat_completion_of_the_same_messages(stack: HttpStack) -> None:
    c = client(stack)
    answer, prompt = last_prompt(stack, lambda: c.responses.create(
        model=served(stack), instructions="Be brief.", input="Hello there", max_output_tokens=6, temperature=0))
    chat, chat_prompt = last_prompt(stack, lambda: c.chat.completions.create(
        model=served(stack), messages=[{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hello there"}], max_tokens=6, temperature=0))
    assert prompt == chat_prompt
    assert answer.output_text == chat.choices[0].message.content and answer.output_text
    assert answer.id.startswith("resp_") and answer.object == "response" and answer.model == served(stack)
    assert answer.status == "incomplete" and answer.incomplete_details is not None
    assert answer.incomplete_details.reason == "max_output_tokens"  # the fake engine ran to max_tokens
    assert chat.usage is not None and answer.usage is not None
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert answer.usage.total_tokens == answer.usage.input_tokens + 6
    [message] = answer.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [p.type for p in message.content] == ["output_text"]
    assert answer.instructions == "Be brief." and answer.max_output_tokens == 6 and answer.temperature == 0


def test_input_items_parts_and_a_partial_assistant_message(stack: HttpStack) -> None:
    """Message items with input_text parts render as chat's text parts; a last assistant message "in_progress"
    is continued (chat's continue_final_message), as vLLM."""
    c = client(stack)
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "you"}]}]
    _, prompt = last_prompt(stack, lambda: c.responses.create(model=served(stack), input=items,  # type: ignore[arg-type]
                                                              max_output_tokens=2))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nyou"}]
    _, chat_prompt = last_prompt(stack, lambda: c.chat.completions.create(model=served(stack), messages=chat,  # type: ignore[arg-type]
                                                                          max_tokens=2))
    assert prompt == chat_prompt
    partial = [{"role": "user", "content": "Hi"},
               {"type": "message", "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "Hello, I am", "annotations": []}]}]
    _, cont = last_prompt(stack, lambda: post(stack, {"input": partial, "max_output_tokens": 2}))
    _, chat_cont = last_prompt(stack, lambda: post(stack, {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}],
        "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 2}, "/v1/chat/completions"))
    assert cont == chat_cont and stack.frontend.tokenizer.decode(cont).endswith("Hello, I am")
    done = {**partial[1], "status": "completed"}  # a finished assistant turn is closed: a new one is generated
    _, closed = last_prompt(stack, lambda: post(stack, {"input": [partial[0], done], "max_output_tokens": 2}))
    assert closed != cont and len(closed) > len(cont)


def test_streaming_sends_vllms_events_in_order(stack: HttpStack) -> None:
    c = client(stack)
    events = list(c.responses.create(model=served(stack), input="Hello there", max_output_tokens=5, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == EVENTS[:4] + ["response.output_text.delta"] * len(deltas) + EVENTS[5:]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    created, done = events[0].response, events[-1].response  # type: ignore[union-attr]
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert done.status == "incomplete" and done.output_text == text and done.usage is not None
    assert done.usage.output_tokens == 5 and created.id == done.id
    item_id = events[2].item.id  # type: ignore[union-attr]
    assert {getattr(e, "item_id", item_id) for e in events[3:-2]} == {item_id} and done.output[0].id == item_id
    assert events[-4].text == text and events[-3].part.text == text  # type: ignore[union-attr]
    whole = c.responses.create(model=served(stack), input="Hello there", max_output_tokens=5)
    assert whole.output_text == text


def test_the_raw_stream_is_event_and_data_lines_without_done(stack: HttpStack) -> None:
    with httpx2.stream("POST", f"{stack.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 2,
                                                                   "stream": True}, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    blocks = raw.strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert "[DONE]" not in raw and blocks[-1].startswith("event: response.completed")


def test_an_engine_failure_mid_stream_is_an_error_event(stack: HttpStack) -> None:
    with httpx2.stream("POST", f"{stack.url}/v1/responses", json={"input": "Hello there", "stream": True,
                                                                   "seed": SEED_FAIL_LATE}, timeout=30) as response:
        raw = response.read().decode()
    last = raw.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error" and json.loads(last[1][6:])["code"]
    assert "response.completed" not in raw
    stack.wait_engine_idle()


def test_sampling_fields_reach_the_engine(stack: HttpStack) -> None:
    body = {"input": "Hi", "max_output_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "seed": 3,
            "stop": ["zz"], "stop_token_ids": [99], "ignore_eos": True, "skip_special_tokens": False,
            "include_stop_str_in_output": True, "logit_bias": {"5": 1.5}, "priority": 2,
            "request_id": "resp_mine-1", "metadata": {"k": "v"}, "user": "u", "store": True,
            "service_tier": "default", "parallel_tool_calls": False, "tool_choice": "none",
            "prompt_cache_key": "x", "include_reasoning": False, "reasoning": {"effort": "low"}}
    answer, _ = last_prompt(stack, lambda: post(stack, body))
    sent = stack.fake.added[-1]
    sp = sent.sampling_params
    assert answer.status_code == 200, answer.text
    assert (sp.max_tokens, sp.top_k, sp.seed, list(sp.stop_token_ids), sp.ignore_eos) == (3, 7, 3, [99], True)
    assert [round(x, 3) for x in (sp.temperature, sp.top_p, sp.min_p, sp.presence_penalty, sp.frequency_penalty,
                                  sp.repetition_penalty)] == [0.5, 0.9, 0.1, 0.5, 0.25, 1.1]
    assert dict(sp.logit_bias) == {5: 1.5} and sent.priority == 2 and sent.request_id.startswith("resp_mine-1")
    out = answer.json()
    assert out["id"] == "resp_mine-1" and out["metadata"] == {"k": "v"} and out["user"] == "u"
    assert (out["service_tier"], out["parallel_tool_calls"], out["tool_choice"]) == ("default", False, "none")
    assert out["reasoning"]["effort"] == "low" and (out["temperature"], out["top_p"]) == (0.5, 0.9)


def test_text_format_json_schema_constrains_the_output(stack: HttpStack) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer, _ = last_prompt(stack, lambda: post(stack, {"input": "Hi", "max_output_tokens": 3, "text": {
        "format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}}}))
    assert answer.status_code == 200, answer.text
    sent = stack.fake.added[-1].sampling_params.structured_outputs
    assert json.loads(sent.json) == schema
    assert answer.json()["text"]["format"]["schema"] == schema
    assert error_of(post(stack, {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "s"}}}),
                    400)["param"] == "text.format.schema"


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "name": "f", "parameters": {}}]), ("include", ["message.output_text.logprobs"]),
    ("top_logprobs", 2), ("truncation", "auto"), ("max_tool_calls", 1), ("prompt", {"id": "p"}),
    ("cache_salt", "salt"), ("structured_outputs", {"regex": "a+"}), ("previous_input_messages", []),
    ("background", True), ("tool_choice", "required"), ("enable_response_messages", True),
])
def test_unsupported_fields_are_400_naming_them(stack: HttpStack, field: str, value: Any) -> None:
    error = error_of(post(stack, {"input": "Hi", field: value}), 400)
    assert error["param"] == field and (field in error["message"] or field in ("background", "tool_choice"))


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}, "input.[0]"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}, "input.[0].content.[0].type"),
])
def test_input_items_other_than_text_messages_are_400(stack: HttpStack, item: dict[str, Any], param: str) -> None:
    assert error_of(post(stack, {"input": [item]}), 400)["param"] == param


def test_errors_name_the_responses_fields(stack: HttpStack) -> None:
    assert error_of(post(stack, {"input": "Hi", "max_output_tokens": CONTEXT + 1}), 400)["param"] == "max_output_tokens"
    assert error_of(post(stack, {"input": "Hi", "temperature": 3}), 400)["param"] == "temperature"
    assert error_of(post(stack, {"input": "Hi", "model": "nope"}), 404)["param"] == "model"
    assert error_of(post(stack, {"input": "x " * CONTEXT}), 400)["param"] == "input"
    assert error_of(post(stack, {}), 400)["param"] == "input"


def test_nothing_is_stored_so_ids_are_404_as_vllm_without_a_store(stack: HttpStack) -> None:
    answer = post(stack, {"input": "Hi", "max_output_tokens": 2, "store": True}).json()
    for got in (httpx2.get(f"{stack.url}/v1/responses/{answer['id']}", timeout=10),
                httpx2.post(f"{stack.url}/v1/responses/{answer['id']}/cancel", timeout=10),
                post(stack, {"input": "Hi", "previous_response_id": answer["id"]})):
        error = error_of(got, 404)
        assert error["message"] == f"Response with id '{answer['id']}' not found." and error["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client(stack).responses.retrieve(answer["id"])


def test_disconnect_mid_stream_aborts_the_request_in_the_engine(stack: HttpStack) -> None:
    reader = SseReader(f"{stack.url}/v1/responses", {"input": "Hi", "stream": True, "max_output_tokens": 100_000 // 50})
    reader.wait_started()
    rid = next(iter(stack.fake.running))
    reader.stop()
    stack.wait_engine_idle(timeout=5)
    assert rid in stack.fake.aborted


def test_admission_bounds_responses_like_every_generation_route(stack: HttpStack) -> None:
    busy = [SseReader(f"{stack.url}/v1/responses", {"input": "Hi", "stream": True, "max_output_tokens": 2000})
            for _ in range(4)]
    try:
        for reader in busy:
            reader.wait_started()
        error = error_of(post(stack, {"input": "Hi", "max_output_tokens": 2}), 429)
        assert error["code"] == "rate_limit_exceeded"
    finally:
        for reader in busy:
            reader.stop()
    stack.wait_engine_idle()


def test_a_big_responses_body_never_stalls_another_stream(stack: HttpStack) -> None:
    """A 3.9 MB input (parsed on a thread, tokenized on the pool, then too long for the context) and a body
    over the limit (413) while a victim stream runs: its gaps stay under MAX_STALL_S."""
    limit = stack.frontend.config.max_message_bytes
    victim = SseReader(f"{stack.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": None, "stream": True})
    try:
        victim.wait_started()
        for body, status in (({"input": "The quick brown fox. " * (3_900_000 // 21)}, 400),
                             ({"input": "x" * (limit + 10)}, 413)):
            answer, gap = victim.during(f"responses body {status}", functools.partial(post, stack, body))
            assert answer.status_code == status
            assert gap < MAX_STALL_S
    finally:
        victim.stop()
    assert victim.error is None
    stack.wait_engine_idle()


def test_responses_are_503_while_draining(stack: HttpStack) -> None:
    stack.frontend.draining = True
    try:
        error = error_of(post(stack, {"input": "Hi", "max_output_tokens": 2}), 503)
        assert error["code"] == "draining"
    finally:
        stack.frontend.draining = False
    wait_until(lambda: post(stack, {"input": "Hi", "max_output_tokens": 2}).status_code == 200, 10, "serving again")


def test_to_chat_maps_every_honoured_field() -> None:
    body = rp.ResponsesRequest.model_validate({
        "input": "Hi", "instructions": "Sys", "max_output_tokens": 9, "chat_template_kwargs": {"a": 1},
        "reasoning": {"effort": "high"}, "text": {"format": {"type": "json_object"}}})
    chat = responses.to_chat(body)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Sys"}, {"role": "user", "content": "Hi"}]
    assert (chat.max_tokens, chat.chat_template_kwargs, chat.reasoning_effort) == (9, {"a": 1}, "high")
    assert chat.response_format is not None and chat.response_format.type == "json_object"
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_max_output_tokens_is_reported_fitted_to_the_context(stack: HttpStack) -> None:
    """Without max_output_tokens the response reports what the context leaves after the prompt (vLLM's
    SamplingParams.max_tokens); the fake engine echoes the prompt, so its first token stops it at once."""
    _, prompt = last_prompt(stack, lambda: post(stack, {"input": "Hello there", "max_output_tokens": 1}))
    answer = post(stack, {"input": "Hello there", "stop_token_ids": [prompt[0]]}).json()
    assert answer["usage"]["input_tokens"] == len(prompt) and answer["usage"]["output_tokens"] == 1
    assert answer["max_output_tokens"] == CONTEXT - len(prompt) and answer["status"] == "completed"


def test_an_empty_answer_is_an_empty_message_or_no_streamed_item(stack: HttpStack) -> None:
    """vLLM's shapes for no text: a message with no content part; streamed, no output item at all."""
    _, prompt = last_prompt(stack, lambda: post(stack, {"input": "Hello there", "max_output_tokens": 1}))
    body = {"input": "Hello there", "stop_token_ids": [prompt[0]]}
    [message] = post(stack, body).json()["output"]
    assert message["content"] == [] and message["status"] == "completed"
    events = list(client(stack).responses.create(model=served(stack), input="Hello there", stream=True,
                                                 extra_body={"stop_token_ids": [prompt[0]]}))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.completed"]
    assert events[-1].response.output == [] and events[-1].response.usage.output_tokens == 1  # type: ignore[union-attr]
