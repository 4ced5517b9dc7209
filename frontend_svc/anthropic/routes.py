"""`POST /v1/messages` and `POST /v1/messages/count_tokens` on the OpenAI HTTP port (docs/anthropic.md).

Per request: read and parse the body under the port's limit (parsed on a thread when large) -> refuse
unsupported fields by name -> check the model -> map it onto a chat completion (convert.py) and check
its tools as the chat route does -> the chat path's prompt and `SamplingParams` -> `Run` (admission,
tokenization on the pool, routing; the same metrics and spans as the other routes, under its own route)
-> the body, or the stream events (answer.py). Every error is in Anthropic's shape (errors.py); a
client that goes away aborts the request in the engine, as on the OpenAI routes.
count_tokens renders and tokenizes the prompt the same request would run with (on the tokenizer pool
under one admission slot) and returns its length.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend_svc.anthropic import convert
from frontend_svc.anthropic import protocol as ap
from frontend_svc.anthropic.answer import MessageBuilder
from frontend_svc.anthropic.errors import JSON, error_response
from frontend_svc.generation import GenerationBackend
from frontend_svc.openai import bodies, sse, tools
from frontend_svc.openai import protocol as p
from frontend_svc.openai.errors import ApiError
from frontend_svc.openai.generations import Run, code_name, from_service
from frontend_svc.openai.http_io import (
    DISCONNECTED,
    BodyLimits,
    collected_answer,
    header_pairs,
    parse_body,
    pick_request_id,
    unless_disconnected,
)
from frontend_svc.service_error import ServiceError
from shared_runtime.contract import SamplingParams
from shared_runtime.violations import ValidationError

ROUTE = "/v1/messages"
COUNT_ROUTE = "/v1/messages/count_tokens"


class OpenAIRoutes(Protocol):
    """What these routes use of the OpenAI app they join (`app.OpenAIApi`)."""

    frontend: GenerationBackend
    tool_call_parser: str | None

    def body_limits(self) -> BodyLimits: ...

    def lora_of(self, model: str | None) -> str:
        """The LoRA adapter `model` names ("" = the base model); 404 model_not_found for an unknown name."""


def routes(api: OpenAIRoutes) -> list[Route]:
    handler = MessagesHandler(api)
    return [Route(ROUTE, handler.create, methods=["POST"]),
            Route(COUNT_ROUTE, handler.count_tokens, methods=["POST"])]


async def guarded(request: Request, handler: Callable[[Request], Awaitable[Response]]) -> Response:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)


class MessagesHandler:
    def __init__(self, api: OpenAIRoutes) -> None:
        self.api = api

    async def create(self, request: Request) -> Response:
        return await guarded(request, self._create)

    async def count_tokens(self, request: Request) -> Response:
        return await guarded(request, self._count_tokens)

    def _chat(self, body: ap.MessagesRequest | ap.CountTokensRequest) -> tuple[p.ChatCompletionRequest, str]:
        """The checked chat request of `body` and its LoRA adapter ("" = the base model; `model` = an
        adapter's name selects it, as in chat completions) (400 / 404 as `ApiError`)."""
        error = convert.unsupported(body)
        if error is not None:
            raise error
        lora = self.api.lora_of(body.model)
        chat = convert.to_chat(body)
        try:
            tools.check(chat, self.api.tool_call_parser)
        except ValidationError as exc:
            raise convert.NAMES.error(exc) from None
        return chat, lora

    async def _count_tokens(self, request: Request) -> Response:
        api, frontend = self.api, self.api.frontend
        body = await parse_body(request, api.body_limits(), ap.CountTokensRequest)
        prompt = bodies.chat_prompt(self._chat(body)[0])
        try:
            ids = await frontend.run_blocking(frontend.tokenize_chat, prompt)
        except ValidationError as exc:
            raise convert.NAMES.error(exc) from None
        except ServiceError as exc:
            raise from_service(exc) from None
        count = len(ids)
        return Response(json.dumps({"input_tokens": count, "context_management": {"original_input_tokens": count}}),
                        media_type=JSON)

    async def _create(self, request: Request) -> Response:
        api, frontend = self.api, self.api.frontend
        body = await parse_body(request, api.body_limits(), ap.MessagesRequest)
        chat, lora = self._chat(body)
        prompt = bodies.chat_prompt(chat)
        params = self._params(chat)
        request_id = pick_request_id(request)
        builder = MessageBuilder(f"msg_{request_id}", lora or frontend.model_name,
                                 tools.tool_calls_factory(chat, api.tool_call_parser))
        run = Run(frontend, header_pairs(request), ROUTE, [prompt], params, request_id, 0, convert.NAMES,
                  bodies.prompt_options(chat), lora_name=lora)
        if await unless_disconnected(request, run.start()) is DISCONNECTED:
            return Response(status_code=499)
        builder.prompt_tokens(len(run.prepared[0].prompt_token_ids))
        headers = {"X-Request-Id": request_id, "request-id": request_id}
        if body.stream:
            return sse.EventStream(_stream(run, builder), on_close=run.close, headers=headers)
        return await collected_answer(request, _collect(run, builder), run.close, headers)

    def _params(self, chat: p.ChatCompletionRequest) -> SamplingParams:
        try:
            params = bodies.sampling_params(chat)
            self.api.frontend.check_fits(1, "messages")
        except ValidationError as exc:
            raise convert.NAMES.error(exc) from None
        return params


async def _collect(run: Run, builder: MessageBuilder) -> str:
    await run.collect(lambda _, delta: builder.add(delta))
    return json.dumps(builder.body(), ensure_ascii=False)


async def _stream(run: Run, builder: MessageBuilder) -> AsyncIterator[str]:
    yield builder.opening()
    try:
        async for _, batch in run.batches():
            text = "".join([builder.events(delta) for delta in batch])
            if text:
                yield text
        run.succeed()
    except ServiceError as exc:
        run.fail(code_name(exc.code), exc.message)
        yield builder.error(from_service(exc))
        return
    yield builder.closing()
