"""The Responses API as vLLM 0.32 serves it for a model without tools or a reasoning parser (text in, text
out): `POST /v1/responses`, `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` (docs/openai.md).

A request becomes a chat completion (`to_chat`: `instructions` a system message first, `input` the
messages, `max_output_tokens` the max_tokens, `text.format` the response_format, `reasoning.effort` the
template's reasoning_effort, the sampling fields as they are), so its prompt, sampling, bounds and
errors are chat's and its greedy text is chat's on the same messages. Only the answer's shape differs
(`ResponseBuilder`): one assistant message with one `output_text` part, `status` "incomplete" with
`incomplete_details.reason` "max_output_tokens" on a length cut, usage as input/output tokens.

Streaming sends vLLM's events, each `event: <type>` + `data: <json>` with `sequence_number` counting
from 0 and no `[DONE]`: response.created, response.in_progress, then — at the first text —
response.output_item.added, response.content_part.added, one response.output_text.delta per piece of
text, response.output_text.done, response.content_part.done, response.output_item.done, and last
response.completed (an answer with no text has no output item, as vLLM). An engine failure after the
status line is an `error` event (OpenAI's ResponseErrorEvent) and the stream ends.

Store: vLLM stores nothing unless started with VLLM_ENABLE_RESPONSES_API_STORE (off by default, and then
its store never forgets), and tandem keeps nothing either: `store` is accepted and changes nothing,
`previous_response_id`, GET and cancel answer 404 "Response with id '...' not found.", `background` is a
400 — vLLM's answers without that variable.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import pydantic
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend_svc.generation import GenerationBackend
from frontend_svc.openai import bodies, sse
from frontend_svc.openai import protocol as p
from frontend_svc.openai import responses_protocol as rp
from frontend_svc.openai.errors import ApiError, FieldNames, bad_request, echo, from_pydantic, raise_if
from frontend_svc.openai.generations import Run, code_name, from_service
from frontend_svc.openai.http_io import (
    DISCONNECTED,
    BodyLimits,
    collected_answer,
    error_response,
    guarded,
    header_pairs,
    parse_body,
    pick_request_id,
    unless_disconnected,
)
from frontend_svc.outputs import CompletionDelta
from frontend_svc.service_error import ServiceError
from shared_runtime.contract import SamplingParams
from shared_runtime.violations import ValidationError


class OpenAIRoutes(Protocol):
    """What these routes use of the OpenAI app they join (`app.OpenAIRoutes`)."""

    frontend: GenerationBackend

    def body_limits(self) -> BodyLimits: ...

    def lora_of(self, model: str | None) -> str:
        """The LoRA adapter `model` names ("" = the base model); 404 model_not_found for an unknown name."""


ROUTE = "/v1/responses"
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: below it sampling is greedy and top_p is reported as 1.0
# the chat request's field names as the Responses request spells them (400s name what the client sent)
RENAMES = {"chat.messages": "input", "messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "response_format.json_schema.schema": "text.format.schema"}


def routes(api: OpenAIRoutes) -> list[Route]:
    handler = ResponsesHandler(api)
    return [Route(ROUTE, handler.create, methods=["POST"]),
            Route(ROUTE + "/{response_id}", handler.retrieve, methods=["GET"]),
            Route(ROUTE + "/{response_id}/cancel", handler.cancel, methods=["POST"])]


def not_stored(response_id: str) -> ApiError:
    """vLLM's answer for an id it has not stored (every id: nothing is stored)."""
    return ApiError(404, f"Response with id '{echo(response_id)}' not found.", param="response_id")


# ---- request ------------------------------------------------------------------------------------------


def unsupported(body: rp.ResponsesRequest) -> ApiError | None:
    """400 naming a field tandem does not implement (set to other than null or vLLM's default), or one
    vLLM refuses too without a store or tools."""
    error = bodies.refused_field(body, rp.REFUSED_RESPONSES)
    if error is not None:
        return error
    if body.background:
        return bad_request("background mode needs a response store, which this server does not keep "
                           "(as vLLM without VLLM_ENABLE_RESPONSES_API_STORE)", "background")
    if body.tool_choice not in ("auto", "none", None):
        return bad_request("tool_choice must be 'auto' or 'none' (tools are not supported)", "tool_choice")
    return None


def input_messages(body: rp.ResponsesRequest) -> tuple[list[dict[str, Any]], bool]:
    """The chat messages of `instructions` + `input` (vLLM's construct_input_messages) and whether the
    last one is a partial assistant message to continue."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages, False
    for i, item in enumerate(body.input):
        if item.type != "message" or item.role is None:
            raise bad_request(f"input items of type {echo(item.type)!r} are not supported (only messages)",
                              f"input.[{i}]")
        messages.append({"role": item.role, "content": _content(item, i)})
    last = body.input[-1] if body.input else None
    partial = last is not None and last.role == "assistant" and last.status in rp.PARTIAL
    return messages, partial


def _content(item: rp.InputItem, index: int) -> str | list[dict[str, str]]:
    """An item's content as chat's: text, or text parts (vLLM keeps only an assistant's first part)."""
    content = item.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type not in rp.TEXT_PARTS or part.text is None:
            raise bad_request(f"content parts of type {echo(part.type)!r} are not supported (only input_text and "
                              f"output_text)", f"input.[{index}].content.[{j}].type")
        parts.append({"type": "text", "text": part.text})
    if item.role == "assistant":
        return parts[0]["text"] if parts else ""
    return parts


def to_chat(body: rp.ResponsesRequest) -> p.ChatCompletionRequest:
    """The chat completion that produces this response's text (every honoured field mapped here)."""
    messages, partial = input_messages(body)
    fmt = body.text.format if body.text is not None else None
    chat: dict[str, Any] = {
        "messages": messages, "model": body.model, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "seed": body.seed, "stop": body.stop,
        "stop_token_ids": body.stop_token_ids, "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens, "include_stop_str_in_output": body.include_stop_str_in_output,
        "logit_bias": body.logit_bias, "priority": body.priority, "chat_template_kwargs": body.chat_template_kwargs,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "add_generation_prompt": not partial, "continue_final_message": partial,
        "response_format": _response_format(fmt),
    }
    try:
        return p.ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except pydantic.ValidationError as exc:
        raise FieldNames(RENAMES).error(_violations(exc)) from None


def _response_format(fmt: rp.TextFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    if fmt.schema_ is None:
        raise bad_request("text.format json_schema needs a schema", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


def _violations(exc: pydantic.ValidationError) -> ValidationError:
    """A chat-side shape error (e.g. a message role the chat model refuses) as tandem's ValidationError."""
    error = from_pydantic(exc)
    return ValidationError.single(error.param or "input", error.message)


# ---- response -----------------------------------------------------------------------------------------


class ResponseBuilder:
    """One response's JSON and stream events, in vLLM's field order (ResponsesResponse.from_request)."""

    def __init__(self, response_id: str, model: str, body: rp.ResponsesRequest, params: SamplingParams) -> None:
        self.id = response_id
        self.model = model
        self.body = body
        self.params = params
        self.created_at = int(time.time())
        self.max_output_tokens = params.max_tokens
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.text = ""
        self.finish_reason: str | None = None
        self.input_tokens = self.cached_tokens = self.output_tokens = 0
        self.sequence_number = 0
        self.opened = False  # the streamed message item exists (at the first text)

    def fitted(self, prompt_tokens: int, max_model_len: int) -> None:
        """The max_tokens the engine runs with (vLLM reports the one fitted to the context)."""
        if self.max_output_tokens is None or prompt_tokens + self.max_output_tokens > max_model_len:
            self.max_output_tokens = max_model_len - prompt_tokens

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if delta.usage is not None:
            self.input_tokens = delta.usage.prompt_tokens
            self.cached_tokens = delta.usage.cached_prompt_tokens
            self.output_tokens += delta.usage.completion_tokens

    # -- whole bodies
    def response(self, status: str = "completed", output: list[dict[str, Any]] | None = None,
                 usage: bool = True) -> dict[str, Any]:
        b, greedy = self.body, self.params.temperature < GREEDY_EPS
        return {
            "id": self.id, "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "metadata": b.metadata, "model": self.model, "object": "response",
            "output": output if output is not None else [], "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": self.params.temperature, "tool_choice": "none", "tools": [],
            "top_p": 1.0 if greedy else self.params.top_p, "background": False,
            "max_output_tokens": self.max_output_tokens, "max_tool_calls": None,
            "previous_response_id": b.previous_response_id, "prompt": None,
            "reasoning": _reasoning_echo(b.reasoning), "service_tier": b.service_tier, "status": status,
            "text": _text_echo(b.text), "top_logprobs": None,
            "truncation": "disabled", "usage": self._usage() if usage else None, "user": b.user,
            "presence_penalty": self.params.presence_penalty, "frequency_penalty": self.params.frequency_penalty,
            "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None, "output_messages": None,
        }

    def final(self, streamed: bool) -> dict[str, Any]:
        """The finished response: the message (a streamed one only if it was opened, as vLLM)."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        output = [self._message("completed")] if self.opened or not streamed else []
        return self.response(status, output)

    def _part(self, text: str, logprobs: list[Any] | None) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    def _message(self, status: str) -> dict[str, Any]:
        content = [self._part(self.text, None)] if status == "completed" and self.text else []
        return {"id": self.message_id, "content": content, "role": "assistant", "status": status,
                "type": "message", "phase": None}

    def _usage(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0,
                                         "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                          "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                "total_tokens": self.input_tokens + self.output_tokens}

    # -- stream events
    def event(self, kind: str, **fields: Any) -> str:
        data = {**fields, "sequence_number": self.sequence_number, "type": kind}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def opening(self) -> str:
        start = self.response("in_progress", usage=False)
        return self.event("response.created", response=start) + self.event("response.in_progress", response=start)

    def text_events(self, delta: CompletionDelta) -> str:
        """The events of one delta (added to the answer here)."""
        self.add(delta)
        if not delta.text:
            return ""
        head = ""
        if not self.opened:
            self.opened = True
            head = (self.event("response.output_item.added", item=self._message("in_progress"), output_index=0)
                    + self.event("response.content_part.added", content_index=0, item_id=self.message_id,
                                 output_index=0, part=self._part("", [])))
        return head + self.event("response.output_text.delta", content_index=0, delta=delta.text,
                                 item_id=self.message_id, logprobs=[], output_index=0)

    def closing(self) -> str:
        tail = ""
        if self.opened:
            part = self._part(self.text, None)
            tail = (self.event("response.output_text.done", content_index=0, item_id=self.message_id, logprobs=[],
                               output_index=0, text=self.text)
                    + self.event("response.content_part.done", content_index=0, item_id=self.message_id,
                                 output_index=0, part=part)
                    + self.event("response.output_item.done", item=self._message("completed"), output_index=0))
        return tail + self.event("response.completed", response=self.final(streamed=True))

    def error(self, error: ApiError) -> str:
        return self.event("error", code=error.code or error.type, message=error.message, param=error.param)


def _reasoning_echo(reasoning: rp.Reasoning | None) -> dict[str, Any] | None:
    """`reasoning` as vLLM echoes it (OpenAI's Reasoning, its fields in that order)."""
    if reasoning is None:
        return None
    return {"context": None, "effort": reasoning.effort, "generate_summary": reasoning.generate_summary,
            "mode": None, "summary": reasoning.summary}


def _text_echo(text: rp.TextConfig | None) -> dict[str, Any] | None:
    """`text` as vLLM echoes it (OpenAI's ResponseTextConfig, its fields in that order)."""
    if text is None:
        return None
    fmt = text.format
    echoed: dict[str, Any] | None = None if fmt is None else {"type": fmt.type}
    if fmt is not None and fmt.type == "json_schema":
        echoed = {"name": fmt.name, "schema": fmt.schema_, "type": fmt.type, "description": fmt.description,
                  "strict": fmt.strict}
    return {"format": echoed, "verbosity": text.verbosity}


# ---- routes -------------------------------------------------------------------------------------------


class ResponsesHandler:
    """The Responses routes on one `OpenAIRoutes` (its frontend, body limit and helpers)."""

    def __init__(self, api: OpenAIRoutes) -> None:
        self.api = api

    async def create(self, request: Request) -> Response:
        return await guarded(request, self._create)

    async def retrieve(self, request: Request) -> Response:
        return error_response(not_stored(request.path_params["response_id"]))

    async def cancel(self, request: Request) -> Response:
        return error_response(not_stored(request.path_params["response_id"]))

    async def _create(self, request: Request) -> Response:
        api, frontend = self.api, self.api.frontend
        body = await parse_body(request, api.body_limits(), rp.ResponsesRequest)
        lora = api.lora_of(body.model)  # `model` = a LoRA adapter's name selects it, as in chat completions
        raise_if(unsupported(body))
        if body.previous_response_id is not None:
            raise not_stored(body.previous_response_id)
        chat = to_chat(body)
        names = FieldNames(RENAMES)
        prompt = bodies.chat_prompt(chat)
        try:
            params = bodies.sampling_params(chat)
            frontend.check_fits(1, "input")
        except ValidationError as exc:
            raise names.error(exc) from None
        response_id = body.request_id or f"resp_{pick_request_id(request)}"
        builder = ResponseBuilder(response_id, lora or frontend.model_name, body, params)
        run = Run(frontend, header_pairs(request), ROUTE, [prompt], params, response_id,
                  body.priority, names, bodies.prompt_options(chat), lora_name=lora)
        if await unless_disconnected(request, run.start()) is DISCONNECTED:
            return Response(status_code=499)
        builder.fitted(len(run.prepared[0].prompt_token_ids), frontend.max_model_len)
        headers = {"X-Request-Id": response_id}
        if body.stream:
            return sse.EventStream(_stream(run, builder), on_close=run.close, headers=headers)
        return await collected_answer(request, _collect(run, builder), run.close, headers)


async def _collect(run: Run, builder: ResponseBuilder) -> str:
    await run.collect(lambda _, delta: builder.add(delta))
    return json.dumps(builder.final(streamed=False), ensure_ascii=False)


async def _stream(run: Run, builder: ResponseBuilder) -> AsyncIterator[str]:
    yield builder.opening()
    try:
        async for _, batch in run.batches():
            text = "".join(_pieces(builder, batch))
            if text:
                yield text
        run.succeed()
    except ServiceError as exc:
        run.fail(code_name(exc.code), exc.message)
        yield builder.error(from_service(exc))
        return
    yield builder.closing()


def _pieces(builder: ResponseBuilder, batch: list[CompletionDelta]) -> Iterator[str]:
    for delta in batch:
        yield builder.text_events(delta)
