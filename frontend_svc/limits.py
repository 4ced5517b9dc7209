"""Per-request size limits, checked before any expensive work (tokenizing, rendering a chat).

They live here, not in a gRPC handler, so every API in front of the processor (the gRPC service, an
HTTP API) applies the same ones: `Processor.process` calls them, `SamplingParams` checks the stop
limits. Each check returns a `FieldViolation` (field = the dot path in `tandem.v1.GenerateRequest`) or
None.

The limits, and why:
- `request_id`: at most 256 bytes of printable ASCII (0x20-0x7E). It is echoed in every response and
  is part of every engine request id, so an unbounded id multiplies into every message.
- Text prompt: at most `max_model_len * PROMPT_BYTES_PER_TOKEN` UTF-8 bytes. The factor (32) is far
  above what real tokenizers produce (about 4 bytes per token for English, under 8 for code or CJK),
  so a prompt this check rejects could never fit in the context window anyway; it only spares the
  tokenizer (and everyone waiting for it) from megabytes that are bound to be rejected.
- Chat: at most `max_model_len` messages (every message renders to at least one token) and the same
  byte budget over all roles and contents, checked before the template runs.
- Token-id prompt: the count is checked against max_model_len before the ids are copied or scanned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from frontend_svc.errors import FieldViolation

MAX_REQUEST_ID_BYTES = 256
PROMPT_BYTES_PER_TOKEN = 32


def max_prompt_bytes(max_model_len: int) -> int:
    """The largest text prompt (UTF-8 bytes) worth tokenizing for this context window."""
    return max_model_len * PROMPT_BYTES_PER_TOKEN


def request_id_violation(request_id: str) -> FieldViolation | None:
    """`request_id` must be at most 256 bytes of printable ASCII (empty means: assign one)."""
    if len(request_id) > MAX_REQUEST_ID_BYTES or not (request_id.isascii() and request_id.isprintable()):
        return FieldViolation(
            "request_id", f"must be at most {MAX_REQUEST_ID_BYTES} printable ASCII characters "
                          f"(got {len(request_id)} characters)")
    return None


def text_size_violation(text: str, max_model_len: int) -> FieldViolation | None:
    """A text prompt larger than the byte budget of the context window."""
    limit = max_prompt_bytes(max_model_len)
    if _utf8_len(text, limit) > limit:
        return FieldViolation("text", f"the prompt is larger than {limit} bytes, which cannot fit in "
                                      f"max_model_len ({max_model_len}) tokens")
    return None


def chat_size_violation(messages: Sequence[Any], max_model_len: int) -> FieldViolation | None:
    """Too many messages, or more text than the context window could hold, before rendering."""
    if len(messages) > max_model_len:
        return FieldViolation("chat.messages", f"the chat has {len(messages)} messages; at most "
                                               f"max_model_len ({max_model_len}) fit in the context")
    limit = max_prompt_bytes(max_model_len)
    total = 0
    for message in messages:
        if isinstance(message, dict):
            for value in (message.get("role"), message.get("content")):
                if isinstance(value, str):
                    total += _utf8_len(value, limit - total)
        if total > limit:
            return FieldViolation("chat.messages", f"the chat is larger than {limit} bytes, which cannot "
                                                   f"fit in max_model_len ({max_model_len}) tokens")
    return None


def _utf8_len(text: str, budget: int) -> int:
    """UTF-8 length of `text`, or just over `budget` when its character count already exceeds it."""
    if len(text) > budget:  # characters never outnumber bytes
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def token_count_violation(count: int, max_model_len: int) -> FieldViolation | None:
    """A token-id prompt that cannot fit (checked before the ids are copied or scanned)."""
    if count >= max_model_len:
        return FieldViolation("token_ids.ids", f"the prompt has {count} tokens; it must be shorter than "
                                               f"max_model_len ({max_model_len})")
    return None
