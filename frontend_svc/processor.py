"""The request processor: prompt (text, token ids or chat) + SamplingParams -> validated token ids.

`Processor.process()` tokenizes and validates one client request and returns a `PreparedRequest`;
`Processor.engine_requests()` expands it into the n `EngineCoreRequest`s the engine needs (the engine
only knows n = 1; shared_runtime/contract.py). Invariants:
- Validation collects every violation before raising one `ValidationError`; each violation's field is
  the dot path in the public proto (`text`, `token_ids.ids`, `chat.messages`, `sampling_params.*`).
- A `PreparedRequest` has a non-empty prompt, every id in [0, vocab_size), and leaves room for
  `max_tokens` (or at least one token) within `max_model_len`.
- Engine request ids are unique within this process (a per-process random tag plus a counter), even
  when clients reuse their `request_id`.
- Size limits (shared_runtime/limits.py: request_id, prompt bytes, chat messages, token count) are
  checked before anything is tokenized or rendered, so an oversized prompt costs next to nothing.
- `process` is thread-safe: the gRPC server runs it on a small thread pool, off the event loop (the
  tokenizer releases the GIL while it encodes).
"""

from __future__ import annotations

import itertools
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared_runtime import limits
from shared_runtime.contract import EngineCoreRequest, SamplingParams
from shared_runtime.violations import FieldViolation, ValidationError

_PROCESS_TAG = secrets.token_hex(4)
_request_counter = itertools.count()


@dataclass
class ChatPrompt:
    """A chat prompt: `messages` are {"role": ..., "content": ...} dicts, rendered by the chat template."""

    messages: list[dict[str, str]]
    add_generation_prompt: bool = True


Prompt = str | Sequence[int] | ChatPrompt


@dataclass
class PreparedRequest:
    """A validated request, ready to be split into n engine requests."""

    request_id: str  # the client's id (assigned when the client gave none); may repeat across requests
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    engine_request_ids: list[str] = field(default_factory=list)  # one per completion, process-unique
    prompt: str | None = None  # the prompt text when the client sent text


class PromptTokenizer(Protocol):
    """What the processor needs of a tokenizer (frontend_svc/tokenizer.py's `Tokenizer` has it)."""

    eos_token_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str: ...


class Processor:
    """Tokenizes and validates requests for one model."""

    def __init__(self, tokenizer: PromptTokenizer, max_model_len: int, vocab_size: int, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.model_name = model_name

    def process(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> PreparedRequest:
        """Tokenize and validate; raise `ValidationError` listing every problem found."""
        violations: list[FieldViolation] = []
        bad_id = limits.request_id_violation(request_id) if request_id else None
        if bad_id is not None:
            violations.append(bad_id)
        if not limits.INT32_MIN <= priority <= limits.INT32_MAX:
            violations.append(FieldViolation("priority", f"must be a 32-bit signed integer, got {priority}"))
        prompt_field, prompt_ids = self._tokenize(prompt, violations)
        violations.extend(v.with_prefix("sampling_params") for v in params.violations(self.vocab_size))
        if prompt_ids:
            self._check_lengths(prompt_field, prompt_ids, params, violations)
        if violations:
            raise ValidationError(violations)
        request_id = request_id or uuid.uuid4().hex
        return PreparedRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            eos_token_ids=list(self.tokenizer.eos_token_ids),
            arrival_time=time.time(),
            priority=priority,
            engine_request_ids=_engine_request_ids(request_id, params.n),
            prompt=prompt if isinstance(prompt, str) else None,
        )

    def engine_requests(self, prepared: PreparedRequest,
                        trace_headers: Mapping[str, str] | None = None) -> list[EngineCoreRequest]:
        """One EngineCoreRequest per completion (completion i samples with seed + i when seeded), each
        carrying `trace_headers` (the caller's trace context, for the engine's span). They share the
        prepared prompt and EOS lists: nothing downstream mutates them."""
        params = prepared.params
        return [
            EngineCoreRequest(
                request_id=engine_id,
                prompt_token_ids=prepared.prompt_token_ids,
                sampling_params=params.engine_params(seed_offset=index),
                eos_token_ids=prepared.eos_token_ids,
                arrival_time=prepared.arrival_time,
                priority=prepared.priority,
                trace_headers=dict(trace_headers or {}),
            )
            for index, engine_id in enumerate(prepared.engine_request_ids)
        ]

    def _tokenize(self, prompt: Prompt, violations: list[FieldViolation]) -> tuple[str, list[int]]:
        """(the prompt's field path, its token ids); appends violations and returns [] when bad."""
        if isinstance(prompt, str):
            return "text", self._tokenize_text(prompt, violations)
        if isinstance(prompt, ChatPrompt):
            return "chat.messages", self._tokenize_chat(prompt, violations)
        return "token_ids.ids", self._check_ids(prompt, violations)

    def _tokenize_text(self, text: str, violations: list[FieldViolation]) -> list[int]:
        if not text:
            violations.append(FieldViolation("text", "the prompt must not be empty"))
            return []
        too_big = limits.text_size_violation(text, self.max_model_len)
        if too_big is not None:
            violations.append(too_big)
            return []
        ids = list(self.tokenizer.encode(text))
        if not ids:
            violations.append(FieldViolation("text", "the prompt encodes to no tokens"))
        return ids

    def tokenize_chat(self, chat: ChatPrompt, add_special_tokens: bool = False) -> list[int]:
        """Render and tokenize a chat (the Tokenize RPC's path); raises ValidationError on `chat.messages`."""
        violations: list[FieldViolation] = []
        ids = self._tokenize_chat(chat, violations, add_special_tokens)
        if violations:
            raise ValidationError(violations)
        return ids

    def _tokenize_chat(
        self, chat: ChatPrompt, violations: list[FieldViolation], add_special_tokens: bool = False
    ) -> list[int]:
        """The template supplies any BOS, so by default no special tokens are added."""
        bad = _chat_violation(chat.messages)
        if bad is not None:
            violations.append(FieldViolation("chat.messages", bad))
            return []
        too_big = limits.chat_size_violation(chat.messages, self.max_model_len)
        if too_big is not None:
            violations.append(too_big)
            return []
        try:
            text = self.tokenizer.render_chat(chat.messages, add_generation_prompt=chat.add_generation_prompt)
        except Exception as exc:  # a template error is the client's input being wrong
            violations.append(FieldViolation("chat.messages", f"the chat template failed: {exc}"))
            return []
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            violations.append(FieldViolation("chat.messages", "the chat renders to no tokens"))
        return ids

    def _check_ids(self, ids: Sequence[int], violations: list[FieldViolation]) -> list[int]:
        if not ids:
            violations.append(FieldViolation("token_ids.ids", "the prompt must not be empty"))
            return []
        too_many = limits.token_count_violation(len(ids), self.max_model_len)
        if too_many is not None:
            violations.append(too_many)
            return []
        ids = list(ids)
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            violations.append(FieldViolation(
                "token_ids.ids", f"every token id must be an integer in [0, {self.vocab_size})"))
            return []
        return ids

    def _check_lengths(
        self, prompt_field: str, ids: list[int], params: SamplingParams, violations: list[FieldViolation]
    ) -> None:
        limit = self.max_model_len
        if len(ids) >= limit:
            violations.append(FieldViolation(
                prompt_field, f"the prompt has {len(ids)} tokens; it must be shorter than "
                              f"max_model_len ({limit})"))
            return
        max_tokens = params.max_tokens
        if isinstance(max_tokens, int) and max_tokens >= 1 and len(ids) + max_tokens > limit:
            violations.append(FieldViolation(
                "sampling_params.max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({limit})"))


def _chat_violation(messages: Sequence[Any]) -> str | None:
    """Why `messages` cannot be rendered, or None when they look fine."""
    if not messages:
        return "the chat must have at least one message"
    for message in messages:
        if not isinstance(message, dict):
            return "every message must be a {role, content} mapping"
        if not isinstance(message.get("role"), str) or not message["role"]:
            return "every message needs a non-empty role"
        if not isinstance(message.get("content"), str):
            return "every message needs a string content"
    return None


def _engine_request_ids(request_id: str, n: int) -> list[str]:
    """n ids for the engine, unique in this process: client id, completion index, process tag + counter."""
    tag = f"{_PROCESS_TAG}{next(_request_counter):x}"
    return [f"{request_id}-{i}-{tag}" for i in range(n)]
