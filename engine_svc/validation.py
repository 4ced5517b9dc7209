"""The engine's own check of every request it is given (defence in depth: it does not trust the frontend).

`request_problem(request)` returns why a request must be rejected, or None. The scheduler
calls it when a request is added; a rejected request ends with an INVALID_ARGUMENT error output (its
stream and every other request on it carry on).

What is checked, and the limits (each is also enforced, tighter or equal, by the frontend):
- request id: non-empty, at most 512 bytes of printable ASCII (the frontend's ids are the client's id,
  at most 256 bytes, plus a short suffix);
- sampling: finite temperature >= 0, top_p in (0, 1], min_p in [0, 1], presence / frequency penalties in
  [-2, 2], repetition penalty finite > 0, max_tokens None or >= 1, 0 <= min_tokens <= max_tokens,
  seed in [0, 2**64), logprobs / prompt_logprobs in [0, 20];
- sizes: at most 1024 stop token ids and 1024 EOS ids, at most 8 trace headers of at most 1024 bytes;
- a finite arrival time (it orders the priority queue).
The prompt itself (empty, longer than max_model_len, ids outside the vocabulary, larger than the KV
cache) is checked by the scheduler next to this call.
"""

from __future__ import annotations

import math

from engine_svc.protocol import EngineSamplingParams
from engine_svc.request import Request

MAX_REQUEST_ID_BYTES = 512
MAX_LOGPROBS = 20
MAX_TOKEN_ID_LIST = 1024
MAX_TRACE_HEADERS = 8
MAX_TRACE_HEADER_BYTES = 1024
_UINT64_LIMIT = 1 << 64


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def request_id_problem(request_id: str) -> str | None:
    if not request_id:
        return "the request id must not be empty"
    if len(request_id) > MAX_REQUEST_ID_BYTES or not (request_id.isascii() and request_id.isprintable()):
        return f"the request id must be at most {MAX_REQUEST_ID_BYTES} printable ASCII characters"
    return None


def sampling_problem(p: EngineSamplingParams) -> str | None:
    """Why these sampling parameters are unusable, or None (the message is built only on failure)."""
    checks: tuple[tuple[bool, str, object, str], ...] = (
        (_finite(p.temperature) and p.temperature >= 0, "temperature", p.temperature, "finite and >= 0"),
        (_finite(p.top_p) and 0 < p.top_p <= 1, "top_p", p.top_p, "in (0, 1]"),
        (_finite(p.min_p) and 0 <= p.min_p <= 1, "min_p", p.min_p, "in [0, 1]"),
        (_finite(p.presence_penalty) and -2 <= p.presence_penalty <= 2, "presence_penalty",
         p.presence_penalty, "in [-2, 2]"),
        (_finite(p.frequency_penalty) and -2 <= p.frequency_penalty <= 2, "frequency_penalty",
         p.frequency_penalty, "in [-2, 2]"),
        (_finite(p.repetition_penalty) and p.repetition_penalty > 0, "repetition_penalty",
         p.repetition_penalty, "finite and > 0"),
        (p.max_tokens is None or p.max_tokens >= 1, "max_tokens", p.max_tokens, "at least 1"),
        (p.min_tokens >= 0 and (p.max_tokens is None or p.min_tokens <= p.max_tokens), "min_tokens",
         p.min_tokens, "in [0, max_tokens]"),
        (p.seed is None or 0 <= p.seed < _UINT64_LIMIT, "seed", p.seed, "in [0, 2**64)"),
        (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, "logprobs", p.logprobs,
         f"in [0, {MAX_LOGPROBS}]"),
        (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
         p.prompt_logprobs, f"in [0, {MAX_LOGPROBS}]"),
    )
    for ok, name, value, rule in checks:
        if not ok:
            return f"{name} must be {rule}, got {value!r}"
    if len(p.stop_token_ids) > MAX_TOKEN_ID_LIST:
        return f"at most {MAX_TOKEN_ID_LIST} stop token ids are allowed, got {len(p.stop_token_ids)}"
    return None


def request_problem(request: Request) -> str | None:
    """Why the engine must reject `request` (before its prompt is looked at), or None."""
    problem = request_id_problem(request.request_id) or sampling_problem(request.sampling_params)
    if problem is not None:
        return problem
    if len(request.eos_token_ids) > MAX_TOKEN_ID_LIST:
        return f"at most {MAX_TOKEN_ID_LIST} EOS token ids are allowed, got {len(request.eos_token_ids)}"
    if not _finite(request.arrival_time):
        return f"arrival_time must be a finite timestamp, got {request.arrival_time}"
    headers = request.trace_headers
    if len(headers) > MAX_TRACE_HEADERS or any(
            len(k) + len(v) > MAX_TRACE_HEADER_BYTES for k, v in headers.items()):
        return (f"trace_headers may hold at most {MAX_TRACE_HEADERS} entries of at most "
                f"{MAX_TRACE_HEADER_BYTES} bytes")
    return None
