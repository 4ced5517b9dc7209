"""The engine's own check of every request it is given (defence in depth: it does not trust the frontend).

`request_problem(request, vocab_size)` returns why a request must be rejected, or None. The scheduler
calls it when a request is added; a rejected request ends with an INVALID_ARGUMENT error output (its
stream and every other request on it carry on).

The sampling rules are the frontend's own: `EngineSamplingParams.violations()` (shared_runtime/contract.py),
with the bounds of shared_runtime/limits.py, so the two sides cannot drift apart. Besides those:
- request id: non-empty, at most 512 bytes of printable ASCII (the frontend's ids are the client's id,
  at most 256 bytes, plus a short suffix);
- at most 1024 EOS ids, at most 8 trace headers of at most 1024 bytes;
- a finite arrival time (it orders the priority queue).
The prompt itself (empty, longer than max_model_len, ids outside the vocabulary, larger than the KV
cache) is checked by the scheduler next to this call.
"""

from __future__ import annotations

import math

from engine_svc.request import Request
from shared_runtime import limits
from shared_runtime.violations import describe


def request_id_problem(request_id: str) -> str | None:
    if not request_id:
        return "the request id must not be empty"
    bound = limits.MAX_ENGINE_REQUEST_ID_BYTES
    if len(request_id) > bound or not (request_id.isascii() and request_id.isprintable()):
        return f"the request id must be at most {bound} printable ASCII characters"
    return None


def request_problem(request: Request, vocab_size: int | None = None) -> str | None:
    """Why the engine must reject `request` (before its prompt is looked at), or None."""
    problem = request_id_problem(request.request_id)
    if problem is not None:
        return problem
    violations = request.sampling_params.violations(vocab_size)
    if violations:
        return describe(v.with_prefix("sampling_params") for v in violations)
    if len(request.eos_token_ids) > limits.MAX_TOKEN_IDS:
        return f"at most {limits.MAX_TOKEN_IDS} EOS token ids are allowed, got {len(request.eos_token_ids)}"
    if not math.isfinite(request.arrival_time):
        return f"arrival_time must be a finite timestamp, got {request.arrival_time}"
    headers = request.trace_headers
    if len(headers) > limits.MAX_TRACE_HEADERS or any(
            len(k) + len(v) > limits.MAX_TRACE_HEADER_BYTES for k, v in headers.items()):
        return (f"trace_headers may hold at most {limits.MAX_TRACE_HEADERS} entries of at most "
                f"{limits.MAX_TRACE_HEADER_BYTES} bytes")
    return None
