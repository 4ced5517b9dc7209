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

`add_size_problem(msg, max_prompt_tokens)` runs first, on the received protobuf: it counts the repeated
fields (never copies them) so an add too large to be worth converting is refused before
`from_pb.request_from_pb` turns its ids into Python lists (a 60 MB add used to cost +1.9 GB).
"""

from __future__ import annotations

import math

from tandem.engine.v1 import engine_core_pb2 as pb

from engine_svc.request import Request
from shared_runtime import limits
from shared_runtime.violations import describe

COPY_FREELY = 4096  # entries of a list any add may have copied before the rules run on it


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


def add_size_problem(msg: pb.EngineCoreRequest, max_prompt_tokens: int) -> str | None:
    """Why an add is too large to even copy (its repeated fields are counted, never copied), or None.
    The engine's server calls this before `request_from_pb`; `request_problem` follows on the struct.

    The prompt may hold at most `max_prompt_tokens` ids. The other lists (EOS and stop ids, logit_bias,
    bad words and their ids, trace headers) are refused here only past `max(max_prompt_tokens,
    COPY_FREELY)` entries, no more than a prompt costs to copy (allowed_token_ids: past its own, larger,
    limit); a smaller excess is copied and refused by the full rules, which name every bad field in the
    frontend's words."""
    n = len(msg.prompt_token_ids) + len(msg.output_token_ids)
    if n > max_prompt_tokens:
        return f"the prompt and its earlier output have {n} tokens, more than max_model_len ({max_prompt_tokens})"
    bound = max(max_prompt_tokens, COPY_FREELY)
    sampling = msg.sampling_params
    words = sampling.bad_words_token_ids
    for name, count, limit in (
            ("eos_token_ids", len(msg.eos_token_ids), bound),
            ("sampling_params.stop_token_ids", len(sampling.stop_token_ids), bound),
            ("sampling_params.logit_bias", len(sampling.logit_bias), bound),
            ("sampling_params.allowed_token_ids", len(sampling.allowed_token_ids),
             max(bound, limits.MAX_ALLOWED_TOKEN_IDS)),
            ("sampling_params.bad_words_token_ids", len(words), bound),
            ("trace_headers", len(msg.trace_headers), bound)):
        if count > limit:
            return f"{name}: {count} entries are too many to read"
    ids = sum(len(word.token_ids) for word in words)  # at most `bound` words, each counted, not copied
    if ids > bound:
        return f"sampling_params.bad_words_token_ids: {ids} ids are too many to read"
    return None
