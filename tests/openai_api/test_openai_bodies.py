"""The OpenAI layer without a server: body validation, request -> SamplingParams, error mapping, and
CompletionDeltas -> OpenAI chunks and responses (shapes checked against OpenAI's API reference)."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from frontend_svc.chat_template import ChatOptions
from frontend_svc.openai import bodies, sse
from frontend_svc.openai import protocol as p
from frontend_svc.openai.errors import ApiError, from_pydantic, service_error
from frontend_svc.outputs import CompletionDelta, TokenLogprob, Usage
from frontend_svc.processor import ChatPrompt
from shared_runtime.contract import StructuredOutputs
from shared_runtime.violations import FieldViolation, ValidationError


def parse_error(model: type[pydantic.BaseModel], body: dict[str, Any]) -> ApiError:
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate_json(json.dumps(body))
    return from_pydantic(info.value)


# ---- request bodies ---------------------------------------------------------------------------------


def test_prompt_forms_and_strict_types() -> None:
    assert p.CompletionRequest.model_validate_json('{"prompt": "hi"}').prompt == "hi"
    assert p.CompletionRequest.model_validate_json('{"prompt": [1, 2]}').prompt == [1, 2]
    assert p.CompletionRequest.model_validate_json('{"prompt": [[1], [2, 3]]}').prompt == [[1], [2, 3]]
    body = p.CompletionRequest.model_validate_json('{"prompt": "x", "temperature": 1, "whatever": {"a": 1}}')
    assert body.temperature == 1.0  # an integer is a number; unknown fields are ignored
    # numbers as vLLM's (lax) pydantic models read them: "0.5", 10.0 and "10" are accepted, 2.5 is no integer
    lax = p.CompletionRequest.model_validate_json(
        '{"prompt": "x", "temperature": "0.5", "max_tokens": 10.0, "n": "1", "top_k": "3", "stream": "false"}')
    assert (lax.temperature, lax.max_tokens, lax.n, lax.top_k, lax.stream) == (0.5, 10, 1, 3, False)
    assert parse_error(p.CompletionRequest, {"prompt": "x", "max_tokens": 2.5}).param == "max_tokens"
    assert parse_error(p.CompletionRequest, {"prompt": "x", "temperature": "hot"}).param == "temperature"
    # but the prompt stays strict, as vLLM's smart union: strings are text prompts, never token ids
    assert p.CompletionRequest.model_validate_json('{"prompt": ["1", "2"]}').prompt == ["1", "2"]
    error = parse_error(p.CompletionRequest, {"prompt": [1, "a"]})
    assert error.param == "prompt" and "list of token ids" in error.message
    assert parse_error(p.CompletionRequest, {"n": 2}).param == "prompt"  # required
    assert parse_error(p.CompletionRequest, {"prompt": "x", "n": [1]}).param == "n"
    assert bodies.sampling_params(completion(seed=-1)).seed is None  # vLLM: -1 is no seed
    assert bodies.sampling_params(completion(seed=-2)).seed == 2**64 - 2


def test_chat_params_use_openai_paths() -> None:
    error = parse_error(p.ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]})
    assert error.param == "messages.[1].role"
    error = parse_error(p.ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert error.param == "messages.[0].content" and "text" in error.message
    assert parse_error(p.ChatCompletionRequest, {"messages": []}).param == "messages"


def test_invalid_json_is_400_without_param() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        p.CompletionRequest.model_validate_json(b"{nope")
    error = from_pydantic(info.value)
    assert error.status == 400 and error.param is None and "JSON" in error.message


def test_an_oversized_logit_bias_is_refused_while_parsing() -> None:
    """Bounded by the body model (parsed off the event loop when large), before the mapper walks it."""
    body = json.dumps({"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(1025)}})
    with pytest.raises(pydantic.ValidationError) as info:
        p.CompletionRequest.model_validate_json(body)
    error = from_pydantic(info.value)
    assert (error.status, error.param) == (400, "logit_bias")
    assert p.CompletionRequest.model_validate_json(body.replace(', "1024": 1.0', "")).logit_bias is not None


# ---- request -> generation inputs ---------------------------------------------------------------------


def chat(**fields: Any) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def completion(**fields: Any) -> p.CompletionRequest:
    return p.CompletionRequest.model_validate({"prompt": "hi", **fields})


def test_sampling_params_carry_every_field() -> None:
    params = bodies.sampling_params(completion(
        n=3, temperature=0.5, top_p=0.9, seed=7, stop=["a", "b"], presence_penalty=0.5, frequency_penalty=-0.5,
        top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=2, ignore_eos=True, stop_token_ids=[3],
        skip_special_tokens=False, include_stop_str_in_output=True, logprobs=2, max_tokens=9,
        logit_bias={"5": 2.0, "0": -100}, allowed_token_ids=[4, 2], bad_words=["no", "never"], stream_interval=4))
    assert (params.n, params.temperature, params.top_p, params.seed, params.stop) == (3, 0.5, 0.9, 7, ["a", "b"])
    assert (params.presence_penalty, params.frequency_penalty, params.top_k, params.min_p) == (0.5, -0.5, 5, 0.1)
    assert (params.repetition_penalty, params.min_tokens, params.ignore_eos, params.stop_token_ids) == (
        1.2, 2, True, [3])
    assert (params.skip_special_tokens, params.include_stop_str_in_output, params.logprobs, params.max_tokens) == (
        False, True, 2, 9)
    assert params.logit_bias == {5: 2.0, 0: -100.0}  # OpenAI's string keys are token ids
    assert (params.allowed_token_ids, params.bad_words, params.stream_interval) == ([4, 2], ["no", "never"], 4)
    assert bodies.sampling_params(chat()).stream_interval is None  # the server's
    assert bodies.sampling_params(completion(stop="x")).stop == ["x"]
    assert bodies.sampling_params(chat(logit_bias={"7": 1e4})).logit_bias == {7: 100.0}  # clamped, as vLLM


def test_defaults_follow_openai() -> None:
    assert bodies.sampling_params(completion()).max_tokens == 16  # completions: 16
    chat_params = bodies.sampling_params(chat())
    assert chat_params.max_tokens is None and chat_params.temperature == 1.0 and chat_params.logprobs is None
    assert bodies.sampling_params(chat(max_tokens=5, max_completion_tokens=7)).max_tokens == 7


def test_chat_logprobs_need_logprobs_true() -> None:
    assert bodies.sampling_params(chat(logprobs=True)).logprobs == 0
    assert bodies.sampling_params(chat(logprobs=True, top_logprobs=3)).logprobs == 3
    with pytest.raises(ApiError) as info:
        bodies.sampling_params(chat(top_logprobs=3))
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize(("request_fields", "field", "param"), [
    ({"top_p": 5.0}, "top_p", "top_p"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"n": 65}, "n", "n"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias", "logit_bias"),
])
def test_bad_values_name_the_openai_field(request_fields: dict[str, Any], field: str, param: str) -> None:
    body = completion(**request_fields)
    with pytest.raises(ValidationError) as info:
        bodies.sampling_params(body)
    assert info.value.fields == [field]
    error = bodies.field_names(body).error(info.value)
    assert (error.status, error.param) == (400, param)


def test_processor_paths_map_to_the_request_fields() -> None:
    names = bodies.field_names(completion())
    assert names.param("text") == names.param("token_ids.ids") == "prompt"
    assert names.param("sampling_params.top_p") == "top_p"
    chat_names = bodies.field_names(chat(max_completion_tokens=5, logprobs=True))
    assert chat_names.param("chat.messages") == "messages"
    assert chat_names.param("sampling_params.max_tokens") == "max_completion_tokens"
    assert chat_names.param("sampling_params.logprobs") == "top_logprobs"
    error = chat_names.error(ValidationError([FieldViolation("chat.messages", "bad"),
                                              FieldViolation("sampling_params.top_p", "worse")]))
    assert error.param == "messages" and "messages: bad" in error.message and "top_p: worse" in error.message


def test_unsupported_fields_are_rejected_not_ignored() -> None:
    cases = [(completion(suffix="s"), "suffix"), (completion(best_of=3), "best_of")]
    for body, param in cases:
        error = bodies.unsupported(body)
        assert error is not None and (error.status, error.param) == (400, param)
    assert bodies.unsupported(completion(best_of=1)) is None
    assert bodies.unsupported(completion(logit_bias={"5": 1.0})) is None  # supported (vLLM semantics)
    assert bodies.unsupported(chat(response_format={"type": "text"})) is None


def test_model_name_must_be_the_served_one() -> None:
    bodies.served_model(None, "m")
    bodies.served_model("m", "m")
    with pytest.raises(ApiError) as info:
        bodies.served_model("gpt-4", "m")
    assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")


def test_prompts_and_chat_messages() -> None:
    assert bodies.completion_prompts("a") == ["a"]
    assert bodies.completion_prompts([1, 2]) == [[1, 2]]
    assert bodies.completion_prompts(["a", "b"]) == ["a", "b"]
    assert bodies.completion_prompts([[1], [2]]) == [[1], [2]]
    with pytest.raises(ApiError):
        bodies.completion_prompts([])
    body = chat(messages=[{"role": "system", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                add_generation_prompt=False)
    assert bodies.chat_prompt(body) == ChatPrompt(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}],
        add_generation_prompt=False, options=ChatOptions())
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ApiError) as info:
        bodies.chat_prompt(image)
    assert info.value.param == "messages.[0].content.[0].type"


# ---- errors -----------------------------------------------------------------------------------------------


def test_service_errors_get_http_statuses() -> None:
    busy = service_error(8, "too many", "TOO_MANY_REQUESTS")
    assert (busy.status, busy.type, busy.headers["Retry-After"]) == (429, "rate_limit_error", "1")
    draining = service_error(14, "draining", "DRAINING")
    assert (draining.status, draining.type, draining.code, draining.headers["Retry-After"]) == (
        503, "server_error", "draining", "1")
    assert service_error(13, "boom", "ENGINE_ERROR").status == 500
    assert service_error(3, "bad", "ENGINE_ERROR").status == 400
    body = json.loads(draining.json())
    assert body == {"error": {"message": "draining", "type": "server_error", "param": None, "code": "draining"}}


# ---- responses ------------------------------------------------------------------------------------------


def delta(index: int, text: str, ids: list[int], *, finish: str | None = None, logprobs: Any = None,
          usage: Usage | None = None, stop_reason: Any = None) -> CompletionDelta:
    return CompletionDelta(request_id="r", index=index, text=text, token_ids=ids, logprobs=logprobs,
                           finish_reason=finish, usage=usage, stop_reason=stop_reason)


def test_completion_chunks_and_response_agree(tokenizer: Any) -> None:
    texts = bodies.TokenTexts(tokenizer)
    stream = bodies.CompletionBuilder("cmpl-x", "m", 2, 2, texts, None)
    whole = bodies.CompletionBuilder("cmpl-x", "m", 2, 2, texts, None)
    deltas = [(0, delta(0, "ab", [1, 2])), (1, delta(1, "", [3])), (1, delta(0, "c", [4])),
              (0, delta(0, "d", [5], finish="stop", stop_reason="zz", usage=Usage(4, 3, 2))),
              (0, delta(1, "e", [6], finish="length", usage=Usage(4, 1, 2))),
              (1, delta(0, "", [], finish="length", usage=Usage(5, 2))),
              (1, delta(1, "f", [7], finish="length", usage=Usage(5, 2)))]
    chunks = [stream.chunk(i, d, with_usage=True) for i, d in deltas]
    for i, d in deltas:
        whole.add(i, d)
    assert chunks[1] is None  # nothing to say yet (text held back)
    sent = [json.loads(c) for c in chunks if c is not None]
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-x" and c["usage"] is None for c in sent)
    streamed: dict[int, str] = {}
    for c in sent:
        choice = c["choices"][0]
        streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    response = json.loads(whole.response())
    assert {c["index"]: c["text"] for c in response["choices"]} == streamed == {0: "abd", 1: "e", 2: "c", 3: "f"}
    assert [c["finish_reason"] for c in response["choices"]] == ["stop", "length", "length", "length"]
    assert response["choices"][0]["stop_reason"] == "zz"
    # prompt tokens once per prompt (4 + 5), completion tokens of all four choices (3 + 1 + 2 + 2)
    assert response["usage"] == {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17,
                                 "prompt_tokens_details": {"cached_tokens": 2}}
    assert json.loads(stream.usage_chunk())["choices"] == [] and json.loads(stream.usage_chunk())["usage"] == \
        response["usage"]


def test_completion_logprobs_shape(tokenizer: Any) -> None:
    texts = bodies.TokenTexts(tokenizer)
    a, b, c = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("a", "b", "c"))
    entries = [TokenLogprob(a, -0.5, 1, top=[(a, -0.5), (b, -1.0)]),
               TokenLogprob(c, float("-inf"), 3, top=[(a, -0.1), (b, -0.2)])]
    builder = bodies.CompletionBuilder("cmpl-x", "m", 1, 1, texts, 2)
    chunk = json.loads(builder.chunk(0, delta(0, "ac", [a, c], logprobs=entries), with_usage=False) or "{}")
    logprobs = chunk["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "c"]
    assert logprobs["token_logprobs"] == [-0.5, bodies.MIN_LOGPROB]  # -inf is not JSON
    assert logprobs["text_offset"] == [0, 1]
    # the top 2, plus the sampled token when it is not among them
    assert logprobs["top_logprobs"] == [{"a": -0.5, "b": -1.0}, {"a": -0.1, "b": -0.2, "c": bodies.MIN_LOGPROB}]
    assert "usage" not in chunk


def test_chat_stream_shape_and_logprobs(tokenizer: Any) -> None:
    texts = bodies.TokenTexts(tokenizer)
    a, b = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("a", "b"))
    builder = bodies.ChatBuilder("chatcmpl-x", "m", 2, 1, texts, 1)
    roles = [json.loads(c) for c in builder.role_chunks(with_usage=False)]
    assert [r["choices"][0] for r in roles] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(2)]
    assert all(r["object"] == "chat.completion.chunk" for r in roles)
    lp = [TokenLogprob(a, -0.25, 1, top=[(a, -0.25), (b, -1.5)])]
    first = json.loads(builder.chunk(0, delta(1, "a", [a], logprobs=lp), with_usage=True) or "{}")
    assert first["choices"][0]["delta"] == {"content": "a"} and first["usage"] is None
    assert first["choices"][0]["logprobs"] == {"content": [
        {"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.25, "bytes": [97]}]}]}
    last = json.loads(builder.chunk(0, delta(1, "", [], finish="stop", stop_reason=2, usage=Usage(3, 1)),
                                    with_usage=True) or "{}")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"


def test_chat_response(tokenizer: Any) -> None:
    builder = bodies.ChatBuilder("chatcmpl-x", "m", 1, 1, bodies.TokenTexts(tokenizer), None)
    builder.add(0, delta(0, "Hel", [1, 2]))
    builder.add(0, delta(0, "lo", [3], finish="length", usage=Usage(7, 3, 0)))
    body = json.loads(builder.response())
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello", "tool_calls": []},
                                "logprobs": None,
                                "finish_reason": "length", "stop_reason": None, "token_ids": None}]
    assert body["usage"]["total_tokens"] == 10


def test_token_bytes_are_the_utf8_of_the_token_text_as_vllm(tokenizer: Any) -> None:
    """A character split over two tokens: the piece's token is "" with no bytes, the completing token
    is the character with its bytes (the texts the output processor gives them, vLLM's convention)."""
    ids = tokenizer.encode("€", add_special_tokens=False)
    assert len(ids) == 3, "the tiny tokenizer should split this character in three"
    builder = bodies.ChatBuilder("chatcmpl-x", "m", 1, 1, bodies.TokenTexts(tokenizer), 1)
    entries = [TokenLogprob(ids[0], -0.5, 1, top=[(ids[0], -0.5)], text="", top_texts=[""]),
               TokenLogprob(ids[2], -0.25, 1, top=[(ids[2], -0.25)], text="€", top_texts=["€"])]
    chunk = json.loads(builder.chunk(0, delta(0, "€", [ids[0], ids[2]], logprobs=entries), with_usage=False)
                       or "{}")
    content = chunk["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in content] == [("", []), ("€", list("€".encode()))]
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [[], list("€".encode())]


def test_completions_take_response_format() -> None:
    """vLLM's completions accept OpenAI's response_format as the chat API does (a JSON object here)."""
    params = bodies.sampling_params(completion(response_format={"type": "json_object"}))
    assert params.structured_outputs == StructuredOutputs(json_object=True)
    assert bodies.sampling_params(completion(response_format={"type": "text"})).structured_outputs is None


def test_sse_framing() -> None:
    assert sse.event('{"a":1}') == 'data: {"a":1}\n\n'
    assert sse.events(["1", "2"]) == "data: 1\n\ndata: 2\n\n"
    assert sse.DONE == "data: [DONE]\n\n"


def test_chat_options_follow_vllm() -> None:
    """chat_template_kwargs, with documents / reasoning_effort (and enable_thinking from it) winning unless
    null; a per-request template; both continue_final_message and add_generation_prompt is a 400."""
    options = bodies.chat_options(chat(chat_template_kwargs={"documents": "old", "x": 1},
                                        documents=[{"title": "t", "text": "d"}], reasoning_effort="low",
                                        chat_template="{{ x }}", continue_final_message=True,
                                        add_generation_prompt=False))
    assert options == ChatOptions(continue_final_message=True, chat_template="{{ x }}",
                                  template_kwargs={"documents": [{"title": "t", "text": "d"}], "x": 1,
                                                   "reasoning_effort": "low", "enable_thinking": True})
    assert bodies.chat_options(chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
                                ).template_kwargs == {"enable_thinking": True, "reasoning_effort": "none"}
    assert bodies.chat_options(chat(chat_template_kwargs={"documents": "kept"})).template_kwargs == {
        "documents": "kept"}
    with pytest.raises(ApiError) as info:
        bodies.chat_options(chat(continue_final_message=True))
    assert info.value.param == "continue_final_message"
    assert parse_error(p.ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}],
                                                 "chat_template": "x" * (64 * 1024 + 1)}).param == "chat_template"


def test_chat_echo_is_the_last_message_of_the_response_role() -> None:
    said = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The sea"}]
    asked = [{"role": "user", "content": "q"}]
    assert bodies.chat_echo(chat(echo=True, add_generation_prompt=False), said) == "The sea"
    assert bodies.chat_echo(chat(echo=True), said) == "The sea"  # the response's role is the assistant's
    assert bodies.chat_echo(chat(echo=True), asked) == ""  # a user message is not the response's
    assert bodies.chat_echo(chat(echo=True, add_generation_prompt=False), asked) == "q"
    assert bodies.chat_echo(chat(), said) == ""


def test_prompt_options_fit_max_tokens_and_carry_truncation() -> None:
    options = bodies.prompt_options(completion(truncate_prompt_tokens=5, truncation_side="right",
                                                add_special_tokens=False))
    assert (options.truncate_prompt_tokens, options.truncation_side, options.add_special_tokens,
            options.fit_max_tokens) == (5, "right", False, True)
    chat_options = bodies.prompt_options(chat())
    assert (chat_options.add_special_tokens, chat_options.truncation_side) == (False, "left")
