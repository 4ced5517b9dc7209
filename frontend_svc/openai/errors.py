"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status
a client (and the OpenAI SDKs' retry logic) expects.

| cause | status | type | code |
|---|---|---|---|
| bad JSON, bad field, bad value (`ValidationError`) | 400 | invalid_request_error | null; `param` names the OpenAI field |
| missing or wrong API key | 401 | authentication_error | invalid_api_key |
| `model` is not the served model | 404 | invalid_request_error | model_not_found |
| body over the limit | 413 | invalid_request_error | request_too_large |
| too many completions in flight (`ServiceError` RESOURCE_EXHAUSTED) | 429 | rate_limit_error | rate_limit_exceeded |
| no ready engine, engine gone, draining (UNAVAILABLE) | 503 | server_error | the service error's reason, lower case |
| anything else from the engine | by its gRPC code (INTERNAL: 500) | server_error | the reason |

429 and 503 carry `Retry-After: 1`, which the OpenAI SDKs honour when they retry. `param` uses
OpenAI's paths (`messages.[0].content`, `top_p`): `ValidationError` fields (paths in the gRPC proto,
`sampling_params.top_p`, `chat.messages`, `text`) are mapped by `FieldNames`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic

from frontend_svc.openai.protocol import ErrorInfo, ErrorResponse
from shared_runtime.violations import ValidationError

# gRPC status code number -> HTTP status (as grpc-gateway maps them).
_HTTP_STATUS = {1: 499, 2: 500, 3: 400, 4: 504, 5: 404, 6: 409, 7: 403, 8: 429, 9: 400, 10: 409, 11: 400,
                12: 501, 13: 500, 14: 503, 15: 500, 16: 401}
_RETRYABLE = {429, 503}
# pydantic names union members in an error's location (`prompt.list[int].0`); these are not fields.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")
_UNION_FIELDS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": 'must be a string or a list of {"type": "text", "text": ...} parts',
}


@dataclass
class ApiError(Exception):
    """An error response: HTTP status, OpenAI error body fields, extra headers."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if self.status in _RETRYABLE:
            self.headers.setdefault("Retry-After", "1")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    def json(self) -> bytes:
        return self.body().model_dump_json().encode()


def raise_if(error: ApiError | None) -> None:
    """Raise `error` unless it is None. Call it as `raise_if(check(...))`: an exception held in a local of a
    frame it is raised through is a reference cycle (the exception's traceback holds the frame), which
    keeps the frame's locals - a refused request's parsed body - until a full garbage collection."""
    if error is not None:
        try:
            raise error
        finally:
            del error


MAX_ECHO_CHARS = 128  # of a client's string (an id, a name, a key) quoted back in an error
MAX_PYDANTIC_ERRORS = 8  # problems of one body listed in its 400 (the rest are counted)


def echo(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """A client's string as an error quotes it: whole when short, else its start and its length (a 3 MB
    id was echoed whole in a 3 MB answer)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unauthorized() -> ApiError:
    return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error", code="invalid_api_key")


def model_not_found(name: str) -> ApiError:
    return ApiError(404, f"The model `{echo(name)}` does not exist.", param="model", code="model_not_found")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def not_found(path: str) -> ApiError:
    return ApiError(404, f"no route {echo(path)}", code="not_found")


def service_error(code: int, message: str, reason: str) -> ApiError:
    """A `ServiceError` (gRPC status code number + stable reason) as an HTTP error."""
    status = _HTTP_STATUS.get(code, 500)
    if status == 429:
        return ApiError(429, message, type="rate_limit_error", code="rate_limit_exceeded")
    if status < 500:
        return ApiError(status, message, code=reason.lower() or None)
    return ApiError(status, message, type="server_error", code=reason.lower() or None)


class FieldNames:
    """Maps `ValidationError` field paths (the gRPC proto's) to the OpenAI request's field names.

    `renames` holds the endpoint's own names: e.g. `text` -> `prompt` for completions,
    `sampling_params.logprobs` -> `top_logprobs` for chat, `sampling_params.max_tokens` ->
    `max_completion_tokens` when the client sent that. Other `sampling_params.X` become `X`."""

    def __init__(self, renames: Mapping[str, str]) -> None:
        self._renames = dict(renames)

    def param(self, proto_field: str) -> str:
        if proto_field in self._renames:
            return self._renames[proto_field]
        bare = proto_field.removeprefix("sampling_params.")
        return self._renames.get(bare, bare)

    def error(self, exc: ValidationError) -> ApiError:
        """400 listing every violation; `param` is the first one's OpenAI field."""
        parts = [f"{self.param(v.field)}: {v.description}" for v in exc.violations]
        return bad_request("; ".join(parts), self.param(exc.violations[0].field))


def from_pydantic(exc: pydantic.ValidationError) -> ApiError:
    """400 for a body whose shape is wrong; `param` is the first bad field in OpenAI's path style."""
    messages: dict[str, str] = {}
    count = exc.error_count()
    for err in exc.errors(include_url=False, include_input=False)[:MAX_PYDANTIC_ERRORS]:
        param, in_union = _param_of(err["loc"])
        if param not in messages:
            field_name = param.rsplit(".", 1)[-1]
            messages[param] = (_UNION_FIELDS.get(field_name, err["msg"]) if in_union
                               else _describe(err))
    first = next(iter(messages), None)
    text = "; ".join(f"{p}: {m}" if p else m for p, m in messages.items())
    if count > MAX_PYDANTIC_ERRORS:
        text += f"; and {count - MAX_PYDANTIC_ERRORS} more problems"
    return bad_request(text or "invalid request body", first or None)


def _param_of(loc: Sequence[Any]) -> tuple[str, bool]:
    """(`messages.[0].content`, whether a union tag was dropped) for a pydantic error location."""
    parts: list[str] = []
    in_union = False
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif _UNION_TAG.match(str(item)):
            in_union = True
            break
        else:
            parts.append(echo(str(item), 64))  # a key the client chose (an unknown field) may be megabytes
    return ".".join(parts), in_union


def _describe(err: Any) -> str:
    if err["type"] == "missing":
        return "this field is required"
    if err["type"] == "json_invalid":
        return f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
    return str(err["msg"])
