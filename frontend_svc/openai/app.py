"""The OpenAI-compatible routes on Starlette, in front of a `FrontendServer` (docs/openai.md).

  POST /v1/completions        POST /v1/chat/completions        GET /v1/models        GET /health
  GET /v1/models/{model_id}   POST /tokenize   POST /detokenize   GET /version   GET|POST /ping
  POST /v1/responses   GET /v1/responses/{id}   POST /v1/responses/{id}/cancel   (responses.py)   GET /metrics
  POST /v1/messages   POST /v1/messages/count_tokens   (Anthropic's Messages API, frontend_svc/anthropic/)
  POST /v1/load_lora_adapter   POST /v1/unload_lora_adapter   (with VLLM_ALLOW_RUNTIME_LORA_UPDATING, lora_routes.py)

Per generation request: read the body (at most `max_body_bytes`, checked from Content-Length before
reading and while reading: 413) -> count its commas and braces against what a request within
max_model_len can hold (400, before parsing) -> parse and validate it with pydantic (on the parse lane
when it is large: one parse at a time, off the loop) -> check the model name and unsupported fields -> build the
prompts and `SamplingParams` -> `Run.start` (admission, tokenization on the pool, routing) -> either
stream SSE chunks or collect the whole response.

Invariants:
- An error before the first token is an HTTP error status with OpenAI's error body (nothing of a
  stream was sent yet); an engine failure mid-stream is a final `data: {"error": ...}` event and
  `data: [DONE]` (the status line already said 200).
- A client that disconnects (mid-stream, or while a non-streaming request runs) closes the `Run`: its
  unfinished completions are aborted in the engine and its admission slots given back.
- With API keys, every route but `/health` and `/ping` needs `Authorization: Bearer <key>` or `X-Api-Key: <key>`
  (Anthropic's header; the same keys and the same constant-time check as the gRPC API). `/health` (and `/ping`) is 200 only while an engine is ready and the
  server is not draining (the readiness of the gRPC health service), else 503.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import prometheus_client
import pydantic
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend_svc.anthropic import routes as messages_routes
from frontend_svc.anthropic.errors import error_response as anthropic_error
from frontend_svc.generation import GenerationBackend
from frontend_svc.openai import bodies, kv_transfer, sse, tools
from frontend_svc.openai import protocol as p
from frontend_svc.openai.errors import (
    ApiError,
    FieldNames,
    bad_request,
    from_pydantic,
    not_found,
    raise_if,
    unauthorized,
)
from frontend_svc.openai.generations import Run, code_name, from_service
from frontend_svc.openai.http_io import (
    DISCONNECTED,
    JSON,
    BodyLimits,
    collected_answer,
    error_response,
    guarded,
    header_pairs,
    json_object,
    off_loop_if_large,
    parse_body,
    pick_request_id,
    read_json_body,
    unless_disconnected,
)
from frontend_svc.openai.raw_body import RawBody
from frontend_svc.outputs import CompletionDelta
from frontend_svc.processor import PreparedRequest
from frontend_svc.service_error import ServiceError
from shared_runtime.contract import SamplingParams
from shared_runtime.security.auth import KeySet
from shared_runtime.violations import ValidationError

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=pydantic.BaseModel)
T = TypeVar("T")
VERSION = importlib.metadata.version("tandem")
HEALTH_PATHS = ("/health", "/ping")  # open without an API key
Builder = bodies.CompletionBuilder | bodies.ChatBuilder


class ApiKeyAuth:
    """ASGI middleware: `Authorization: Bearer <key>` or `X-Api-Key: <key>` on every path but /health and /ping
    (keys may be None: off); a refusal in Anthropic's error shape on its routes, else OpenAI's."""

    def __init__(self, app: ASGIApp, keys: KeySet | None) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys is not None and scope["path"] not in HEALTH_PATHS:
            headers = dict(scope["headers"])
            header, api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
            ok = (self.keys.check_authorization(header.decode("latin-1") if header is not None else None)
                  or (api_key is not None and self.keys.accepts(api_key.decode("latin-1"))))
            if not ok:
                refuse = anthropic_error if scope["path"].startswith(messages_routes.ROUTE) else error_response
                await refuse(unauthorized())(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIApi:
    """The routes, bound to one frontend (`GenerationBackend`: nothing else of it is used here)."""

    def __init__(self, frontend: GenerationBackend, max_body_bytes: int, tool_call_parser: str | None = None,
                 trust_request_chat_template: bool = False) -> None:
        self.frontend = frontend
        self.max_body_bytes = max_body_bytes
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" (frontend_svc/openai/tools.py)
        self.trust_request_chat_template = trust_request_chat_template  # else a request's template is a 400
        self.texts = bodies.TokenTexts(frontend.tokenizer)
        self.created = int(time.time())
        self.fingerprint = system_fingerprint(frontend.model_name)

    def body_limits(self) -> BodyLimits:
        """A request body's bounds for the model served now (max_model_len is the ready engines')."""
        f = self.frontend
        return BodyLimits.for_model(self.max_body_bytes, f.max_model_len, f.vocab_size)

    def asgi(self) -> ASGIApp:
        from frontend_svc.openai import lora_routes, responses  # they build on this module's helpers

        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/ping", self.health, methods=["GET", "POST"]),  # vLLM's (SageMaker's) /health
                  Route("/version", self.version, methods=["GET"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/metrics", self.metrics, methods=["GET"]),  # as vLLM's port; --metrics-port's too
                  *responses.routes(self), *messages_routes.routes(self), *lora_routes.routes(self)]
        app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _server_error})
        return ApiKeyAuth(app, self.frontend.api_keys)

    # ---- routes ------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        f = self.frontend
        if f.serving:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "draining" if f.draining else "no ready engine"}, status_code=503)

    async def models(self, request: Request) -> Response:
        """The served model, then each LoRA adapter with `parent` = the base model (vLLM's list)."""
        cards = [self._card(), *(self._card(name) for name in self.frontend.lora_adapters)]
        return Response(p.ModelList(data=cards).model_dump_json(exclude_none=True), media_type=JSON)

    async def model(self, request: Request) -> Response:
        """OpenAI's GET /v1/models/{model}: the served model's or an adapter's card, 404 model_not_found for
        any other id."""
        try:
            lora = self.lora_of(request.path_params["model_id"])
        except ApiError as exc:
            return error_response(exc)
        return Response(self._card(lora).model_dump_json(exclude_none=True), media_type=JSON)

    def _card(self, lora: str = "") -> p.ModelCard:
        f = self.frontend
        if lora:
            return p.ModelCard(id=lora, created=self.created, root=lora, parent=f.model_name,
                               max_model_len=f.max_model_len)
        return p.ModelCard(id=f.model_name, created=self.created, max_model_len=f.max_model_len)

    def lora_of(self, model: str | None) -> str:
        """The LoRA adapter a body's `model` names ("" = the base); 404 model_not_found for an unknown one."""
        return bodies.served_model(model, self.frontend.model_name, self.frontend.lora_adapters)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def metrics(self, request: Request) -> Response:
        """The frontend's Prometheus metrics (the registry --metrics-port serves), rendered off the loop;
        404 when metrics are off (--metrics-port 0)."""
        registry = self.frontend.metrics_registry
        if registry is None:
            return error_response(ApiError(404, "metrics are off (--metrics-port 0)", code="not_found"))
        body = await asyncio.to_thread(prometheus_client.generate_latest, registry)
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        return await guarded(request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await guarded(request, self._detokenize)

    # ---- tokenization (vLLM's /tokenize and /detokenize, on the tokenizer pool like prompts) -------------
    async def _tokenize(self, request: Request) -> Response:
        """The chat form when the body has `messages`, else the prompt form (vLLM's union)."""
        f = self.frontend
        raw = await read_json_body(request, self.body_limits())
        data = await off_loop_if_large(raw, json_object, raw)
        body: p.TokenizeCompletionRequest | p.TokenizeChatRequest
        try:
            if "messages" in data:
                body = p.TokenizeChatRequest.model_validate(data)
            else:
                body = p.TokenizeCompletionRequest.model_validate(data)
        except pydantic.ValidationError as exc:
            raise from_pydantic(exc) from None
        self.lora_of(body.model)
        if isinstance(body, p.TokenizeChatRequest):
            self._check_chat_template(body.chat_template)
            chat = bodies.tokenize_chat_prompt(body)
            ids = await self._blocking(lambda c: f.tokenize_chat(c, body.add_special_tokens), chat,
                                       {"chat.messages": "messages"})
        else:
            ids = await self._blocking(lambda t: f.tokenize_text(t, body.add_special_tokens), body.prompt,
                                       {"text": "prompt"})
        strs = self.frontend.tokenizer.token_strings(ids) if body.return_token_strs else None
        out = p.TokenizeResponse(count=len(ids), max_model_len=f.max_model_len, tokens=ids, token_strs=strs)
        return Response(out.model_dump_json(), media_type=JSON)

    async def _detokenize(self, request: Request) -> Response:
        body = await parse_body(request, self.body_limits(), p.DetokenizeRequest)
        self.lora_of(body.model)
        text = await self._blocking(lambda ids: self.frontend.detokenize_ids(ids, skip_special_tokens=False),
                                    body.tokens, {"token_ids": "tokens"})
        return Response(p.DetokenizeResponse(prompt=text).model_dump_json(), media_type=JSON)

    async def _blocking(self, fn: Callable[[Any], T], arg: Any, renames: dict[str, str]) -> T:
        """`fn(arg)` on the frontend's tokenizer pool; its ValidationError as a 400 naming the HTTP field."""
        try:
            return await self.frontend.run_blocking(fn, arg)
        except ValidationError as exc:
            raise FieldNames(renames).error(exc) from None
        except ServiceError as exc:
            raise from_service(exc) from None

    async def completions(self, request: Request) -> Response:
        return await guarded(request, self._completions)

    async def chat_completions(self, request: Request) -> Response:
        return await guarded(request, self._chat)

    # ---- generation ----------------------------------------------------------------------------------
    async def _completions(self, request: Request) -> Response:
        body = await parse_body(request, self.body_limits(), p.CompletionRequest)
        lora = self._check(body)
        prompts = bodies.completion_prompts(body.prompt)
        names = bodies.field_names(body)
        params = self._params(body, names, len(prompts))
        kv = kv_transfer.request_params(body.kv_transfer_params, params.n, len(prompts), self.frontend.max_model_len)
        request_id = pick_request_id(request, body.request_id)
        builder = bodies.CompletionBuilder(f"cmpl-{request_id}", lora or self.frontend.model_name, body.n,
                                            len(prompts), self.texts, params.logprobs,
                                            bodies.extras(body, self.fingerprint))
        run = Run(self.frontend, header_pairs(request), "/v1/completions", prompts, params, request_id,
                  body.priority, names, bodies.prompt_options(body), lora_name=lora, kv_transfer_params=kv)
        return await self._respond(request, run, builder, body, request_id)

    async def _chat(self, request: Request) -> Response:
        body = await parse_body(request, self.body_limits(), p.ChatCompletionRequest)
        lora = self._check(body)
        names = bodies.field_names(body)
        try:
            tools.check(body, self.tool_call_parser)
        except ValidationError as exc:
            raise names.error(exc) from None
        self._check_chat_template(body.chat_template)
        prompt = bodies.chat_prompt(body)
        params = self._params(body, names, 1)
        kv = kv_transfer.request_params(body.kv_transfer_params, params.n, 1, self.frontend.max_model_len)
        request_id = pick_request_id(request, body.request_id)
        builder = bodies.ChatBuilder(f"chatcmpl-{request_id}", lora or self.frontend.model_name, body.n, 1,
                                      self.texts, params.logprobs, echo=bodies.chat_echo(body, prompt.messages),
                                      extras=bodies.extras(body, self.fingerprint))
        builder.with_tool_calls(tools.tool_calls_factory(body, self.tool_call_parser))
        run = Run(self.frontend, header_pairs(request), "/v1/chat/completions", [prompt], params, request_id,
                  body.priority, names, bodies.prompt_options(body), lora_name=lora, kv_transfer_params=kv)
        return await self._respond(request, run, builder, body, request_id)

    def _check_chat_template(self, template: str | None) -> None:
        """A request's own template only with --trust-request-chat-template (vLLM's rule and message)."""
        if template is not None and not self.trust_request_chat_template:
            raise bad_request("Chat template is passed with request, but --trust-request-chat-template is not "
                              "set. Refused request with untrusted chat template.", "chat_template")

    def _check(self, body: p.CompletionRequest | p.ChatCompletionRequest) -> str:
        """The body's LoRA adapter ("" = the base model) once the body passes the checks every route makes."""
        lora = self.lora_of(body.model)
        raise_if(bodies.unsupported(body))
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        return lora

    def _params(self, body: p.CompletionRequest | p.ChatCompletionRequest, names: FieldNames,
                num_prompts: int) -> SamplingParams:
        try:
            params = bodies.sampling_params(body)
            # all prompts x n completions at once, or never: each prompt's own take() could not tell
            self.frontend.check_fits(num_prompts * params.n, "n" if num_prompts == 1 else "prompt")
        except ValidationError as exc:
            raise names.error(exc) from None
        return params

    async def _respond(self, request: Request, run: Run, builder: Builder,
                       body: p.CompletionRequest | p.ChatCompletionRequest, request_id: str) -> Response:
        headers = {"X-Request-Id": request_id}
        if await unless_disconnected(request, run.start()) is DISCONNECTED:
            return Response(status_code=499)
        builder.prompts = [self._prompt_info(prepared, builder.extras.echo) for prepared in run.prepared]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse.EventStream(_stream(run, builder, include_usage), on_close=run.close, headers=headers,
                                   on_raw=_direct_writer(run, builder, include_usage))
        return await collected_answer(request, _collect(run, builder), run.close, headers)

    def _prompt_info(self, prepared: PreparedRequest, echo: bool) -> bodies.PromptInfo:
        """A prompt's ids, and its text when echoed (a token prompt's decoded with its special tokens, as
        vLLM's renderer decodes it; at most max_model_len ids)."""
        text = prepared.prompt if prepared.prompt is not None or not echo else \
            self.frontend.tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False)
        return bodies.PromptInfo(text or "", prepared.prompt_token_ids)

async def _collect(run: Run, builder: Builder) -> str:
    await run.collect(builder.add)
    return str(builder.response())


async def _stream(run: Run, builder: Builder, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: chunks per batch, the usage chunk if asked, `[DONE]`; an engine error as an event."""
    try:
        if isinstance(builder, bodies.ChatBuilder):
            yield sse.events(builder.role_chunks(include_usage))
        async for prompt_index, batch in run.batches():
            chunks = [c for c in (builder.chunk(prompt_index, d, include_usage) for d in batch) if c is not None]
            if chunks:
                yield sse.events(chunks)
        if include_usage:
            yield sse.event(builder.usage_chunk())
        run.succeed()
    except ServiceError as exc:
        run.fail(code_name(exc.code), exc.message)
        yield sse.event(from_service(exc).body().model_dump_json())
    yield sse.DONE


def _direct_writer(run: Run, builder: Builder, include_usage: bool) -> Callable[[RawBody], None]:
    """Once the stream's body is a `RawBody`: the run's deltas that `_stream` would write one event each
    are written by the processing of engine output instead (`Run.write_directly`), the same event bytes
    and in the same order, while the body's task waits (finishes, errors and everything before the first
    token still go through `_stream`)."""
    def attach(raw: RawBody) -> None:
        chunk, write_now = builder.chunk, raw.write_now

        def write(delta: CompletionDelta) -> bool:
            if not raw.writable:
                return False
            data = chunk(0, delta, include_usage)
            if data is not None:
                write_now(sse.event(data).encode())
            return True
        run.write_directly(write)
    return attach


def system_fingerprint(model_name: str) -> str:
    """vLLM's `system_fingerprint` shape (`vllm-<version>-<hash8>`): tandem's version and 8 hex digits of
    a hash of the served model's name, the same for every response of this server."""
    return f"tandem-{VERSION}-{hashlib.sha256(model_name.encode()).hexdigest()[:8]}"


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(not_found(request.url.path))
    return error_response(ApiError(exc.status_code, str(exc.detail)))


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in %s", request.url.path)
    return error_response(ApiError(500, "internal server error", type="server_error"))
