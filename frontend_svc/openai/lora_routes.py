"""vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, served only when the environment
sets `VLLM_ALLOW_RUNTIME_LORA_UPDATING` to 1 or true (as vLLM: otherwise the routes do not exist, 404).

    POST /v1/load_lora_adapter   {"lora_name": "sql", "lora_path": "/adapters/sql", "load_inplace": false}
    POST /v1/unload_lora_adapter {"lora_name": "sql"}

Success is vLLM's: 200, a plain-text line. Refusals are vLLM's statuses and messages, in OpenAI's error shape
with vLLM's error types:

| cause | status | type |
|---|---|---|
| lora_name or lora_path empty; lora_name is the base model's; already served (without load_inplace) | 400 | InvalidUserInput |
| the path holds no adapter (no adapter_config.json) | 404 | NotFoundError ("Loading lora X failed: No adapter found for P") |
| an adapter the engines cannot serve (rank, targets, shapes, weights...; vLLM answers 500), a relative path | 400 | InvalidUserInput |
| past --max-cpu-loras, LoRA off on the engines | 400 | BadRequestError |
| unload of a name no engine serves | 404 | NotFoundError |
| no ready engine | 503 | ServiceUnavailableError |

The path is read by the engines on their own hosts (docs/security.md: why this is off by default).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Protocol

import grpc
import pydantic
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from frontend_svc.engines.lora_admin import RUNTIME_UPDATES_ENV, LoraAdminError, runtime_updates_allowed
from frontend_svc.generation import GenerationBackend
from frontend_svc.openai.errors import ApiError
from frontend_svc.openai.http_io import BodyLimits, guarded, parse_body

logger = logging.getLogger(__name__)

LOAD_ROUTE, UNLOAD_ROUTE = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
_STATUS = {grpc.StatusCode.NOT_FOUND: (404, "NotFoundError"), grpc.StatusCode.ALREADY_EXISTS: (400, "InvalidUserInput"),
           grpc.StatusCode.INVALID_ARGUMENT: (400, "InvalidUserInput"),
           grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError")}


class OpenAIRoutes(Protocol):
    """What these routes use of the OpenAI app they join (`app.OpenAIApi`)."""

    frontend: GenerationBackend

    def body_limits(self) -> BodyLimits: ...


class LoadLoRAAdapterRequest(pydantic.BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(pydantic.BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def routes(api: OpenAIRoutes, environ: Mapping[str, str] = os.environ) -> list[Route]:
    if not runtime_updates_allowed(environ):
        return []
    logger.warning("LoRA dynamic loading & unloading is enabled in the API server (%s): a caller can make the "
                   "engines read any adapter directory on their hosts", RUNTIME_UPDATES_ENV)
    handler = _Handler(api)
    return [Route(LOAD_ROUTE, handler.load, methods=["POST"]), Route(UNLOAD_ROUTE, handler.unload, methods=["POST"])]


class _Handler:
    def __init__(self, api: OpenAIRoutes) -> None:
        self.api = api

    async def load(self, request: Request) -> Response:
        return await guarded(request, self._load)

    async def unload(self, request: Request) -> Response:
        return await guarded(request, self._unload)

    async def _load(self, request: Request) -> Response:
        body = await parse_body(request, self.api.body_limits(), LoadLoRAAdapterRequest)
        try:
            await self.api.frontend.lora_admin.load(body.lora_name, body.lora_path, body.load_inplace)
        except LoraAdminError as exc:
            raise _from_admin(exc) from None
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def _unload(self, request: Request) -> Response:
        body = await parse_body(request, self.api.body_limits(), UnloadLoRAAdapterRequest)
        try:
            await self.api.frontend.lora_admin.unload(body.lora_name)
        except LoraAdminError as exc:
            raise _from_admin(exc) from None
        logger.info("Removed LoRA adapter: name '%s'", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _from_admin(exc: LoraAdminError) -> ApiError:
    status, kind = _STATUS.get(exc.code, (400, "BadRequestError"))
    if exc.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED):
        status, kind = 500, "InternalServerError"
    return ApiError(status, exc.message, kind)
