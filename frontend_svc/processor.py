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
  tokenizer releases the GIL while it encodes). It also builds the stop strings' automaton there, so
  the output processor never builds one on the loop.
"""

from __future__ import annotations

import itertools
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from frontend_svc.chat_template import ChatOptions
from shared_runtime import limits
from shared_runtime.contract import EngineCoreRequest, KvTransferParams, SamplingParams
from shared_runtime.stop import StopAutomaton, compile_stops
from shared_runtime.violations import FieldViolation, ValidationError

_PROCESS_TAG = secrets.token_hex(4)
_request_counter = itertools.count()


@dataclass
class ChatPrompt:
    """A chat prompt: `messages` are {"role": ..., "content": ...} dicts, rendered by the chat template
    (`options`: continue the final message, a per-request template, extra template variables)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    options: ChatOptions | None = None


@dataclass(frozen=True)
class PromptOptions:
    """How an API shapes a prompt beyond its text (vLLM's TokenizeParams); the defaults are the gRPC API's.

    - `add_special_tokens`: None = True for text (e.g. BOS), False for chats (the template adds them).
    - `truncate_prompt_tokens`: keep at most this many prompt tokens (-1: max_model_len - 1); the kept
      ones are the last (`truncation_side` "left", vLLM's default) or the first ("right").
    - `fit_max_tokens`: a max_tokens larger than what is left of the context generates to the end of the
      context (finish "length") instead of being refused; one larger than max_model_len itself is
      still refused (vLLM's OpenAI server).
    """

    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    fit_max_tokens: bool = False


_DEFAULT_OPTIONS = PromptOptions()


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
    prompt: str | None = None  # the prompt text when the client sent text, the rendered chat for a chat
    # The stop strings' automaton, built by `process` (on the tokenizer pool, off the event loop); the
    # output processor's checkers share it.
    stop_automaton: StopAutomaton | None = None
    lora_name: str = ""  # the LoRA adapter its engine requests run under ("" = the base model)
    # P/D driven by the client (an OpenAI body's kv_transfer_params): sent with its engine request as is.
    kv_transfer_params: KvTransferParams | None = None


class PromptTokenizer(Protocol):
    """What the processor needs of a tokenizer (frontend_svc/tokenizer.py's `Tokenizer` has it)."""

    eos_token_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    options: ChatOptions | None = None) -> str: ...


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
        options: PromptOptions | None = None,
    ) -> PreparedRequest:
        """Tokenize and validate; raise `ValidationError` listing every problem found. `params` is never
        modified: what the processor derives (bad words' token ids, a fitted max_tokens) is in the
        returned request's copy."""
        options = options or _DEFAULT_OPTIONS
        violations: list[FieldViolation] = []
        bad_id = limits.request_id_violation(request_id) if request_id else None
        if bad_id is not None:
            violations.append(bad_id)
        if not limits.INT32_MIN <= priority <= limits.INT32_MAX:
            violations.append(FieldViolation("priority", f"must be a 32-bit signed integer, got {priority}"))
        prompt_field, prompt_ids, rendered = self._tokenize(prompt, options, violations)
        violations.extend(v.with_prefix("sampling_params") for v in params.violations(self.vocab_size))
        if prompt_ids:
            prompt_ids = self._truncated(prompt_ids, options, violations)
        if prompt_ids:
            params = self._check_lengths(prompt_field, prompt_ids, params, options, violations)
        if params.bad_words and not violations:
            params = self._with_bad_words(params, violations)
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
            prompt=prompt if isinstance(prompt, str) else rendered,
            stop_automaton=compile_stops(params.stop) if params.stop else None,
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
                lora_name=prepared.lora_name,
                kv_transfer_params=prepared.kv_transfer_params,
            )
            for index, engine_id in enumerate(prepared.engine_request_ids)
        ]

    def _tokenize(self, prompt: Prompt, options: PromptOptions,
                  violations: list[FieldViolation]) -> tuple[str, list[int], str | None]:
        """(the prompt's field path, its token ids, a chat's rendered text); appends violations and
        returns [] when bad."""
        special = options.add_special_tokens
        if isinstance(prompt, str):
            return "text", self._tokenize_text(prompt, violations, special is not False, options), None
        if isinstance(prompt, ChatPrompt):
            rendered: list[str] = []
            return "chat.messages", self._tokenize_chat(prompt, violations, bool(special), rendered), \
                (rendered[0] if rendered else None)
        return "token_ids.ids", self._check_ids(prompt, violations, options.truncate_prompt_tokens is None), None

    def _tokenize_text(self, text: str, violations: list[FieldViolation], add_special_tokens: bool = True,
                       options: PromptOptions = _DEFAULT_OPTIONS) -> list[int]:
        if not text:
            violations.append(FieldViolation("text", "the prompt must not be empty"))
            return []
        too_big = limits.text_size_violation(text, self.max_model_len)
        if too_big is not None and options.truncate_prompt_tokens is not None:
            # Truncating anyway: cut the text to the byte budget's length in characters first, on the
            # truncated side (vLLM's _text_len_check), so a huge prompt costs no huge tokenization.
            budget = limits.max_prompt_bytes(self.max_model_len)
            text, too_big = (text[-budget:] if options.truncation_side == "left" else text[:budget]), None
        if too_big is not None:
            violations.append(too_big)
            return []
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
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
        self, chat: ChatPrompt, violations: list[FieldViolation], add_special_tokens: bool = False,
        rendered: list[str] | None = None,
    ) -> list[int]:
        """The template supplies any BOS, so by default no special tokens are added. The rendered text is
        appended to `rendered` when given."""
        bad = _chat_violation(chat.messages)
        if bad is not None:
            violations.append(FieldViolation("chat.messages", bad))
            return []
        too_big = limits.chat_size_violation(chat.messages, self.max_model_len)
        if too_big is not None:
            violations.append(too_big)
            return []
        try:
            text = self.tokenizer.render_chat(chat.messages, add_generation_prompt=chat.add_generation_prompt,
                                              options=chat.options)
        except Exception as exc:  # a template error is the client's input being wrong
            violations.append(FieldViolation("chat.messages", f"the chat template failed: {exc}"))
            return []
        if rendered is not None:
            rendered.append(text)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            violations.append(FieldViolation("chat.messages", "the chat renders to no tokens"))
        return ids

    def _check_ids(self, ids: Sequence[int], violations: list[FieldViolation], check_count: bool = True) -> list[int]:
        """The ids, checked; their count only when `check_count` (a prompt being truncated may be longer)."""
        if not ids:
            violations.append(FieldViolation("token_ids.ids", "the prompt must not be empty"))
            return []
        too_many = limits.token_count_violation(len(ids), self.max_model_len) if check_count else None
        if too_many is not None:
            violations.append(too_many)
            return []
        ids = list(ids)
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            violations.append(FieldViolation(
                "token_ids.ids", f"every token id must be an integer in [0, {self.vocab_size})"))
            return []
        return ids

    def _truncated(self, ids: list[int], options: PromptOptions, violations: list[FieldViolation]) -> list[int]:
        """The prompt cut to `truncate_prompt_tokens` (vLLM: -1 = max_model_len - 1; more than
        max_model_len is refused; 0 leaves nothing, which is refused as an empty prompt)."""
        keep = options.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > self.max_model_len:
            violations.append(FieldViolation(
                "truncate_prompt_tokens", f"must be at most max_model_len ({self.max_model_len}), got {keep}"))
            return []
        if keep < 0:
            keep = self.max_model_len - 1
        if keep >= len(ids):
            return ids
        if keep == 0:
            violations.append(FieldViolation("truncate_prompt_tokens", "truncating to 0 tokens leaves an "
                                                                      "empty prompt"))
            return []
        return ids[-keep:] if options.truncation_side == "left" else ids[:keep]

    def _check_lengths(
        self, prompt_field: str, ids: list[int], params: SamplingParams, options: PromptOptions,
        violations: list[FieldViolation],
    ) -> SamplingParams:
        """`params`, with max_tokens fitted to the context when `options.fit_max_tokens` asks for it."""
        limit = self.max_model_len
        if len(ids) >= limit:
            violations.append(FieldViolation(
                prompt_field, f"the prompt has {len(ids)} tokens; it must be shorter than "
                              f"max_model_len ({limit})"))
            return params
        max_tokens = params.max_tokens
        if not (isinstance(max_tokens, int) and max_tokens >= 1 and len(ids) + max_tokens > limit):
            return params
        if options.fit_max_tokens and max_tokens <= limit:
            fitted = limit - len(ids)
            if params.min_tokens > fitted:
                violations.append(FieldViolation(
                    "sampling_params.min_tokens", f"prompt ({len(ids)} tokens) + min_tokens "
                                                  f"({params.min_tokens}) exceeds max_model_len ({limit})"))
                return params
            return msgspec.structs.replace(params, max_tokens=fitted)
        if options.fit_max_tokens:
            violations.append(FieldViolation(
                "sampling_params.max_tokens", f"must be at most max_model_len ({limit}), got {max_tokens}"))
        else:
            violations.append(FieldViolation(
                "sampling_params.max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({limit})"))
        return params

    def _with_bad_words(self, params: SamplingParams, violations: list[FieldViolation]) -> SamplingParams:
        """`params` with `bad_words_token_ids`: each word tokenized as it is (left-stripped) and with a
        leading space, the second kept only when it is a different word of the same length in tokens
        (vLLM's SamplingParams.update_from_tokenizer, so a word is banned at the start of the text and
        after a space)."""
        sequences: list[list[int]] = []
        for word in params.bad_words:
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                violations.append(FieldViolation("sampling_params.bad_words",
                                                 f"{word[:32]!r} tokenizes to no tokens"))
                return params
            sequences.append(plain)
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        try:
            return msgspec.structs.replace(params, bad_words_token_ids=sequences)
        except ValidationError as exc:
            violations.extend(v.with_prefix("sampling_params") for v in exc.violations)
            return params


def _chat_violation(messages: Sequence[Any]) -> str | None:
    """Why `messages` cannot be rendered, or None when they look fine."""
    if not messages:
        return "the chat must have at least one message"
    for message in messages:
        if not isinstance(message, dict):
            return "every message must be a {role, content} mapping"
        if not isinstance(message.get("role"), str) or not message["role"]:
            return "every message needs a non-empty role"
        if not isinstance(message.get("content"), str) and not (message.get("tool_calls") and
                                                                  message.get("content") is None):
            return "every message needs a string content"
    return None


def _engine_request_ids(request_id: str, n: int) -> list[str]:
    """n ids for the engine, unique in this process: client id, completion index, process tag + counter."""
    tag = f"{_PROCESS_TAG}{next(_request_counter):x}"
    return [f"{request_id}-{i}-{tag}" for i in range(n)]
