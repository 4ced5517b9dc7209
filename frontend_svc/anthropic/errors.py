"""Errors in Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`.

The HTTP status is the one the OpenAI routes answer for the same cause (frontend_svc/openai/errors.py:
400 bad input, 401 no key, 404 unknown model or route, 413 body too large, 429 admission full, 503 no
ready engine or draining, 500 otherwise; 429 and 503 with `Retry-After: 1`), which is what Anthropic's
SDK keys its exceptions and retries on. The error `type` is Anthropic's name for that status. A
message names the offending field first (`messages.[0].content.[1].type: ...`) when there is one.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from frontend_svc.openai.errors import ApiError

JSON = "application/json"
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
         499: "invalid_request_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(error: ApiError) -> dict[str, Any]:
    message = error.message
    if error.param and not message.startswith(f"{error.param}:"):
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": error_type(error.status), "message": message}}


def error_response(error: ApiError) -> Response:
    return Response(json.dumps(error_body(error), ensure_ascii=False), status_code=error.status, media_type=JSON,
                    headers=error.headers)
