"""OpenAI requests -> what the generation path takes; `CompletionDelta`s -> OpenAI bodies.

Requests: `served_model`, `unsupported`, `completion_prompts` / `chat_prompt` and `sampling_params` turn
a validated body into prompts and one `SamplingParams` (which validates itself with the contract's
rules, shared_runtime/contract.py, so both APIs share one set), and `field_names` says how to name a rejected field in the OpenAI request.

Responses: choices are numbered prompt index * n + completion index (as vLLM does for batched prompts);
`CompletionBuilder` and `ChatBuilder` turn deltas into stream chunks (one per delta
that carries something) or fold them into the final response, and sum usage over prompts (each prompt
counted once, every completion's tokens counted). `TokenTexts` decodes logprob tokens, cached per id.
A delta's chunk is built as plain dicts and serialised by `dump` (the hot path: no pydantic model per
chunk, token or top-logprob entry); a chat chunk's logprobs are spliced in as text joined from JSON
fragments cached per token (`TokenPieces.json`) and one `dump` of their floats; a chunk that carries text
only (the usual token) is its choice's template, dumped once, with the dumped text spliced in; the bytes
are exactly the response models' (protocol.py; tests/openai_api/test_chunk_bytes.py).

Invariants:
- Concatenating a choice's chunk texts gives the non-streaming text (both come from the same deltas).
- Logprobs are finite in JSON (-inf, NaN -> -9999.0, as vLLM writes them).
- Chat `bytes` are a token's exact bytes for byte-level BPE (so concatenating them gives the UTF-8
  text even when a character spans tokens); otherwise the UTF-8 of the decoded token text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import pydantic_core

from frontend_svc.chat_template import ChatOptions
from frontend_svc.openai import protocol as p
from frontend_svc.openai import structured, tools
from frontend_svc.openai.errors import ApiError, FieldNames, bad_request, echo, model_not_found, raise_if
from frontend_svc.outputs import CompletionDelta, TokenLogprob
from frontend_svc.processor import ChatPrompt, Prompt, PromptOptions
from shared_runtime.contract import SamplingParams
from shared_runtime.token_texts import TokenTexts as SharedTokenTexts
from shared_runtime.violations import ValidationError

MIN_LOGPROB = -9999.0
_TOKEN_CACHE_LIMIT = 1 << 16
LogprobsT = TypeVar("LogprobsT")  # logprobs in some form: dicts (`_logprobs`) or JSON text (`_logprobs_json`)


# ---- requests ---------------------------------------------------------------------------------------


def served_model(requested: str | None, served: str, lora_adapters: Sequence[str] = ()) -> str:
    """The LoRA adapter `requested` names ("" = the base model); 404 model_not_found unless it is the served
    model's name (or absent, as vLLM allows) or one of the served adapters' (vLLM: model = the adapter)."""
    if requested is None or requested == served:
        return ""
    if requested in lora_adapters:
        return requested
    raise model_not_found(requested)


def unsupported(request: p.CompletionRequest | p.ChatCompletionRequest) -> ApiError | None:
    """400 for a field tandem knows but does not implement (never silently ignored): one of vLLM's that
    tandem refuses (`protocol.REFUSED_*`) set to something other than null or vLLM's default, or one of
    OpenAI's below."""
    error = refused_field(request, p.REFUSED_COMPLETION if isinstance(request, p.CompletionRequest) else p.REFUSED_CHAT)
    if (error is None and isinstance(request, p.CompletionRequest) and request.best_of is not None
            and request.best_of != request.n):
        return bad_request("best_of must equal n (beam-style best_of is not supported)", "best_of")
    return error


def refused_field(body: Any, refused: dict[str, object]) -> ApiError | None:
    """400 naming the first of `refused` (field -> vLLM's default) that `body` sets to neither null nor
    that default: a field tandem knows and does not implement is never silently ignored."""
    for name, default in refused.items():
        value = getattr(body, name)
        if value is not None and value != default:
            return bad_request(f"{name} is not supported by this server (only {json.dumps(default)} or null)",
                               name)
    return None


def completion_prompts(prompt: p.CompletionPrompt) -> list[Prompt]:
    """The prompt field as one processor prompt per choice group; 400 on an empty batch."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # list[int]: one token-id prompt
    return list(prompt)  # list[str] or list[list[int]]: a batch


def chat_prompt(request: p.ChatCompletionRequest) -> ChatPrompt:
    """Messages as the chat template takes them (text parts joined by newlines, as vLLM does), with the
    tools and the messages' tool calls (tools.py)."""
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content parts of type {echo(part.type)!r} are not supported (only 'text')",
                                      f"messages.[{i}].content.[{j}].type")
                texts.append(part.text)
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = tools.message_tool_calls(message.tool_calls)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    return ChatPrompt(messages=messages, add_generation_prompt=request.add_generation_prompt,
                      options=chat_options(request))


def tokenize_chat_prompt(request: p.TokenizeChatRequest) -> ChatPrompt:
    """/tokenize's messages as /v1/chat/completions would render them (same fields, same checks)."""
    fields = {name: getattr(request, name) for name in type(request).model_fields if name != "return_token_strs"}
    chat = p.ChatCompletionRequest.model_construct(**fields)
    raise_if(unsupported(chat))
    return chat_prompt(chat)


def chat_options(request: p.ChatCompletionRequest) -> ChatOptions:
    """vLLM's chat rendering extras: `chat_template_kwargs`, with `documents` and `reasoning_effort`
    (and `enable_thinking` from it) winning over the same names there unless they are null
    (vLLM's build_chat_params); 400 for both continue_final_message and add_generation_prompt."""
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    kwargs = dict(request.chat_template_kwargs or {})
    extras: dict[str, Any] = {"documents": request.documents, "reasoning_effort": request.reasoning_effort}
    if request.reasoning_effort is not None and "enable_thinking" not in kwargs:
        extras["enable_thinking"] = request.reasoning_effort != "none"
    kwargs.update((k, v) for k, v in extras.items() if v is not None)
    return ChatOptions(continue_final_message=request.continue_final_message,
                       chat_template=request.chat_template, template_kwargs=kwargs,
                       tools=tools.template_tools(request))


def chat_echo(request: p.ChatCompletionRequest, messages: list[dict[str, str]]) -> str:
    """What `echo` prepends to every choice's content: the last message's content when its role is the
    response's (the assistant's with add_generation_prompt, else the last message's own), as vLLM."""
    if not request.echo or not messages:
        return ""
    role = "assistant" if request.add_generation_prompt else messages[-1]["role"]
    return messages[-1]["content"] if messages[-1]["role"] == role else ""


def prompt_options(request: p.CompletionRequest | p.ChatCompletionRequest) -> PromptOptions:
    """How the processor shapes the prompt: vLLM's add_special_tokens, truncate_prompt_tokens and
    truncation_side, and a max_tokens beyond the context fitted to it (finish "length"), as vLLM's
    OpenAI server does."""
    return PromptOptions(add_special_tokens=request.add_special_tokens,
                         truncate_prompt_tokens=request.truncate_prompt_tokens,
                         truncation_side=request.truncation_side or "left", fit_max_tokens=True)


def max_tokens_of(request: p.CompletionRequest | p.ChatCompletionRequest) -> int | None:
    if isinstance(request, p.ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def logprobs_of(request: p.CompletionRequest | p.ChatCompletionRequest) -> int | None:
    """Top-N logprobs to ask the engine for (None: none); chat needs logprobs=true for top_logprobs."""
    if isinstance(request, p.CompletionRequest):
        return request.logprobs
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def prompt_logprobs_of(request: p.CompletionRequest | p.ChatCompletionRequest) -> int | None:
    """Top-N logprobs per prompt token to ask for: `prompt_logprobs`, else with `echo` the logprobs asked
    for the output (completions `logprobs`, chat `top_logprobs`, 0 when absent), as vLLM's
    to_sampling_params. 400 with
    `stream` (vLLM: not available when streaming) unless 0, and below -1."""
    top = request.prompt_logprobs
    if top is not None:
        if top < -1:
            raise bad_request("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
        if request.stream and top != 0:
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        return top
    if not request.echo:
        return None
    if isinstance(request, p.CompletionRequest):
        return request.logprobs
    return 0 if request.top_logprobs is None else request.top_logprobs  # vLLM: chat top_logprobs defaults to 0


def _seed(seed: int | None) -> int | None:
    """vLLM's seed: -1 is none (random); another negative 64-bit seed is taken modulo 2**64."""
    if seed is None or seed == -1:
        return None
    return seed % (1 << 64) if -(1 << 63) <= seed < 0 else seed


def sampling_params(request: p.CompletionRequest | p.ChatCompletionRequest) -> SamplingParams:
    """The request's `SamplingParams` (the one place OpenAI's sampling fields are mapped); raises
    ValidationError (bare field names, which `field_names` maps to OpenAI's). Completions `echo` with
    max_tokens 0 asks for the prompt alone: one token is generated (and not shown), as vLLM does."""
    stop = request.stop
    max_tokens = max_tokens_of(request)
    if isinstance(request, p.CompletionRequest) and request.echo and max_tokens == 0:
        max_tokens = 1
    return SamplingParams(
        temperature=_or(request.temperature, 1.0),
        top_p=_or(request.top_p, 1.0),
        top_k=_or(request.top_k, 0),
        min_p=_or(request.min_p, 0.0),
        seed=_seed(request.seed),
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=[stop] if isinstance(stop, str) else stop or [],
        stop_token_ids=request.stop_token_ids or [],
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        presence_penalty=_or(request.presence_penalty, 0.0),
        frequency_penalty=_or(request.frequency_penalty, 0.0),
        repetition_penalty=_or(request.repetition_penalty, 1.0),
        logprobs=logprobs_of(request),
        prompt_logprobs=prompt_logprobs_of(request),
        n=request.n,
        skip_special_tokens=request.skip_special_tokens,
        logit_bias=_logit_bias(request.logit_bias),
        allowed_token_ids=request.allowed_token_ids or [],
        bad_words=request.bad_words or [],
        structured_outputs=structured.request_constraint(
            request, tools.constraint(request) if isinstance(request, p.ChatCompletionRequest) else None),
        stream_interval=request.stream_interval,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings (JSON keys); values are clamped and
    checked by `SamplingParams`."""
    token_ids: dict[int, float] = {}
    for token, value in (bias or {}).items():
        if not (token.isascii() and token.isdigit()):
            raise ValidationError.single("logit_bias", f"keys must be token ids (non-negative integers), "
                                                       f"got {token[:32]!r}")
        token_ids[int(token)] = value
    return token_ids


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def field_names(request: p.CompletionRequest | p.ChatCompletionRequest) -> FieldNames:
    """How this request's fields are named, for mapping `ValidationError` paths back to it."""
    if isinstance(request, p.CompletionRequest):
        return FieldNames({"text": "prompt", "token_ids.ids": "prompt", "prompt": "prompt"})
    renames = {"chat.messages": "messages", "logprobs": "top_logprobs"}
    if request.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    return FieldNames(renames)


# ---- responses ----------------------------------------------------------------------------------------


def finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN compares False: clamped too


class TokenTexts:
    """Token id -> its text (the tokenizer's `token_texts` cache, shared with the output processor);
    `pieces`: the logprob rows' cached token forms, shared by every request of the app."""

    def __init__(self, tokenizer: Any) -> None:
        self._texts: SharedTokenTexts = tokenizer.token_texts
        self.pieces = TokenPieces(self)

    def text(self, token_id: int) -> str:
        return self._texts.text(token_id)


Piece = tuple[str, list[int]]  # a logprob row's token as shown, and its `bytes`


class TokenPieces:
    """What a logprob row shows of a token, cached: (token, UTF-8 bytes of it). Only pure functions are
    cached: per token id the token's own decode (`text`), or "token_id:N" with return_tokens_as_token_ids
    (two tables: the option changes the form); a text the output processor gave an entry (a piece of a
    multi-byte character differs by context) is never keyed by id, only its bytes by the text itself.
    Bounded: a table is cleared when it reaches _TOKEN_CACHE_LIMIT entries. The byte lists are shared
    between chunks: they are only serialised, never mutated."""

    __slots__ = ("_by_id", "_by_text", "_json", "_json_by_id", "_texts")

    def __init__(self, texts: Any) -> None:
        self._texts = texts  # TokenTexts' interface: text(token_id)
        self._by_id: tuple[dict[int, Piece], dict[int, Piece]] = ({}, {})  # [as_token_ids]
        self._by_text: dict[str, list[int]] = {}
        self._json: dict[str, RowJson] = {}
        self._json_by_id: tuple[dict[int, tuple[str, str]], dict[int, tuple[str, str]]] = ({}, {})  # .later

    def of(self, token_id: int, text: str | None, as_token_ids: bool) -> Piece:
        """The row's token for `token_id` (whose text is `text` when the entry carries one) and its bytes."""
        if text is None or as_token_ids:
            table = self._by_id[as_token_ids]
            piece = table.get(token_id)
            if piece is None:
                if len(table) >= _TOKEN_CACHE_LIMIT:
                    table.clear()
                token = token_id_text(token_id) if as_token_ids else self._texts.text(token_id)
                piece = table[token_id] = (token, utf8(token))
            return piece
        return text, self.utf8(text)

    def utf8(self, text: str) -> list[int]:
        """`utf8(text)`, cached by the text."""
        data = self._by_text.get(text)
        if data is None:
            if len(self._by_text) >= _TOKEN_CACHE_LIMIT:
                self._by_text.clear()
            data = self._by_text[text] = utf8(text)
        return data

    def json(self, token: str) -> RowJson:
        """The JSON around a logprob of the token `token` shows (its bytes are `utf8(token)`), cached by
        the token; `dump`'s escaping (pydantic-core's), so the bytes are the dicts'."""
        row = self._json.get(token)
        if row is None:
            if len(self._json) >= _TOKEN_CACHE_LIMIT:
                self._json.clear()
            head = '{"token":' + dump(token) + ',"logprob":'
            data = ',"bytes":' + dump(utf8(token))
            row = self._json[token] = RowJson(head, (head, data + "}"), ("," + head, data + "}"),
                                              data + ',"top_logprobs":[')
        return row

    def rows_json(self, entry: TokenLogprob, own: RowJson, count: int, as_token_ids: bool, parts: list[str],
                  logprobs: list[float]) -> None:
        """`ranked(entry, count, as_token_ids)` as chat rows' JSON (TopLogprob's fields), but for their
        logprobs: per row, appends the text before and after its logprob to `parts` and its finite
        logprob to `logprobs`. `own` is the JSON of the entry's own token (the first row)."""
        if count < 1:
            return
        parts += own.first
        logprobs.append(finite(entry.logprob))
        if count == 1 or not entry.top:
            return
        if entry.top_texts is not None:  # alternatives with context texts: the general walk
            for (token, _), logprob in self.ranked(entry, count, as_token_ids)[1:]:
                parts += self.json(token).later
                logprobs.append(logprob)
            return
        table = self._json_by_id[as_token_ids]  # ranked()'s common case, inlined, with rows cached by id
        seen = {entry.token_id}
        n = 1
        for tid, lp in entry.top:
            if tid not in seen:
                seen.add(tid)
                parts += table.get(tid) or self._id_json(tid, as_token_ids)
                logprobs.append(lp if lp >= MIN_LOGPROB else MIN_LOGPROB)  # finite(), inlined
                n += 1
                if n == count:
                    break

    def _id_json(self, token_id: int, as_token_ids: bool) -> tuple[str, str]:
        table = self._json_by_id[as_token_ids]
        if len(table) >= _TOKEN_CACHE_LIMIT:
            table.clear()
        row = table[token_id] = self.json(self.of(token_id, None, as_token_ids)[0]).later
        return row

    def ranked(self, entry: TokenLogprob, count: int, as_token_ids: bool) -> list[tuple[Piece, float]]:
        """The first `count` of vLLM's logprob dict of a position (the token first, then the top-N by
        rank, each id once), each as its piece and its finite logprob."""
        out = [(self.of(entry.token_id, entry.text, as_token_ids), finite(entry.logprob))] if count > 0 else []
        if count > 1 and entry.top:
            seen = {entry.token_id}
            texts = entry.top_texts
            if texts is None:  # the common case, inlined: every alternative is its own decode
                table = self._by_id[as_token_ids]
                for tid, lp in entry.top:
                    if tid not in seen:
                        seen.add(tid)
                        piece = table.get(tid) or self.of(tid, None, as_token_ids)
                        out.append((piece, lp if lp >= MIN_LOGPROB else MIN_LOGPROB))  # finite(), inlined
                        if len(out) == count:
                            break
                return out
            for (tid, lp), text in zip(entry.top, texts):
                if tid not in seen:
                    seen.add(tid)
                    out.append((self.of(tid, text, as_token_ids), finite(lp)))
                    if len(out) == count:
                        break
        return out


class RowJson(NamedTuple):
    """The JSON text around the logprob of a chat logprob row (TopLogprob: token, logprob, bytes) or entry
    (ChatTokenLogprob: the same, then top_logprobs) of one token."""

    head: str  # '{"token":"...","logprob":'
    first: tuple[str, str]  # a row's (head, ',"bytes":[...]}'): the first of a top_logprobs list
    later: tuple[str, str]  # the same after another row: ',' + head
    entry_tail: str  # ',"bytes":[...],"top_logprobs":[' (its rows follow, then ']}')


def utf8(text: str) -> list[int]:
    """A logprob token's `bytes`: the UTF-8 of its text, as vLLM writes them (a piece of a character,
    whose text is "", has none; the token that completes it has the whole character's)."""
    return list(text.encode("utf-8", "replace"))


def token_id_text(token_id: int) -> str:
    """return_tokens_as_token_ids's token text (vLLM's placeholder)."""
    return f"token_id:{token_id}"


@dataclass(frozen=True)
class Extras:
    """vLLM's response extras a request asked for (`extras`)."""

    echo: bool = False  # completions: the prompt (text, logprobs) before each choice's own
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token is generated, unshown)
    token_ids: bool = False  # return_token_ids: prompt_token_ids and token_ids
    as_token_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:N"
    prompt_logprobs: bool = False  # the prompt_logprobs field (asked for, or implied by echo)
    fingerprint: str | None = None  # system_fingerprint


def extras(request: p.CompletionRequest | p.ChatCompletionRequest, fingerprint: str | None) -> Extras:
    echo = bool(request.echo) and isinstance(request, p.CompletionRequest)
    return Extras(echo=echo, echo_only=echo and request.max_tokens == 0,
                  token_ids=bool(request.return_token_ids), as_token_ids=bool(request.return_tokens_as_token_ids),
                  prompt_logprobs=prompt_logprobs_of(request) is not None, fingerprint=fingerprint)


@dataclass
class PromptInfo:
    """What a response may repeat of one prompt: its text (echo) and ids."""

    text: str
    token_ids: list[int]


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    completion_logprobs: dict[str, list[Any]] | None = None  # CompletionLogprobs' fields
    chat_logprobs: list[dict[str, Any]] | None = None  # ChatTokenLogprob's fields
    prompt_logprobs: p.PromptLogprobs | None = None
    offset: int = 0  # characters of text before the next token (completions text_offset)
    started: bool = False  # a delta of this choice was seen (echo and prompt_token_ids go first)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Usage:
    """Prompt tokens once per prompt, completion tokens over every choice."""

    def __init__(self) -> None:
        self._prompts: dict[int, tuple[int, int]] = {}
        self.completion_tokens = 0

    def add(self, prompt_index: int, delta: CompletionDelta) -> None:
        usage = delta.usage
        if usage is not None:
            self._prompts[prompt_index] = (usage.prompt_tokens, usage.cached_prompt_tokens)
            self.completion_tokens += usage.completion_tokens

    def info(self) -> p.UsageInfo:
        prompt = sum(t for t, _ in self._prompts.values())
        cached = sum(c for _, c in self._prompts.values())
        return p.UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                           total_tokens=prompt + self.completion_tokens,
                           prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))


class _Builder:
    """What both endpoints share: ids, choice numbering, per-choice state, usage, vLLM's extras."""

    def __init__(self, response_id: str, model: str, n: int, num_prompts: int, texts: TokenTexts,
                 top_n: int | None, extras: Extras | None = None) -> None:
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.n = n
        self.texts = texts
        self.pieces: TokenPieces = getattr(texts, "pieces", None) or TokenPieces(texts)
        self.top_n = top_n  # None: no logprobs asked
        self.extras = extras or Extras()
        self.prompts: list[PromptInfo] = []  # per prompt index, set once the prompts are tokenized
        self.choices = [_Choice() for _ in range(n * num_prompts)]
        self.usage = _Usage()
        self.tool_calls: list[tools.ToolCalls] = []  # chat: one per choice while tool calls are parsed
        self.kv_transfer_params: dict[str, Any] | None = None  # the engine's kept K/V (openai/kv_transfer.py)
        self._templates: dict[tuple[int, bool], tuple[str, str]] = {}  # (choice, with_usage) -> text chunk's JSON

    def index(self, prompt_index: int, delta: CompletionDelta) -> int:
        return prompt_index * self.n + delta.index

    def _record(self, prompt_index: int, delta: CompletionDelta) -> _Choice:
        choice = self.choices[self.index(prompt_index, delta)]
        if delta.prompt_logprobs is not None and self.extras.prompt_logprobs and choice.prompt_logprobs is None:
            choice.prompt_logprobs = [None, *(self._prompt_position(e) for e in delta.prompt_logprobs)]
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason
            self.usage.add(prompt_index, delta)
            if delta.kv_transfer_params is not None:
                self.kv_transfer_params = delta.kv_transfer_params
        return choice

    def _prompt_position(self, entry: TokenLogprob) -> dict[str, p.PromptLogprob]:
        """vLLM's prompt logprobs of one position: the prompt's token (its rank), then the top-N by rank,
        keyed by token id; texts are the real tokens' even with return_tokens_as_token_ids."""
        out = {str(entry.token_id): p.PromptLogprob(logprob=finite(entry.logprob), rank=entry.rank,
                                                     decoded_token=self._text(entry.token_id, entry.text))}
        for rank, (tid, lp), text in zip(range(1, len(entry.top) + 1), entry.top, _top_texts(entry)):
            out.setdefault(str(tid), p.PromptLogprob(logprob=finite(lp), rank=rank,
                                                     decoded_token=self._text(tid, text)))
        return out

    def _text(self, token_id: int, text: str | None) -> str:
        return text if text is not None else self.texts.text(token_id)

    def _token(self, token_id: int, text: str | None) -> str:
        """A logprob token's text as the response shows it (return_tokens_as_token_ids: "token_id:N")."""
        if self.extras.as_token_ids:
            return token_id_text(token_id)
        return self._text(token_id, text)

    @staticmethod
    def _dump(chunk: Any, with_usage: bool = False) -> str:
        """A stream chunk: fields the builder set (nulls included) and `object`, nothing else; with
        `with_usage` (stream_options.include_usage) also `"usage": null`, as OpenAI sends it."""
        chunk.object = chunk.object  # an explicit assignment marks the constant as set
        if with_usage:
            chunk.usage = None
        return str(chunk.model_dump_json(exclude_unset=True))

    def _stamp(self, body: dict[str, Any], finished: bool, with_usage: bool) -> None:
        """vLLM's system_fingerprint on a stream's last chunk of a choice, unless a usage chunk ends it."""
        if finished and not with_usage and self.extras.fingerprint is not None:
            body["system_fingerprint"] = self.extras.fingerprint

    def _ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.extras.token_ids else None

    def _text_chunk(self, index: int, text: str, with_usage: bool) -> str:
        """The chunk of a text-only delta of choice `index` (no finish, logprobs or ids): its JSON around the
        text is the same for every such delta, so it is dumped once (`_text_body`, with an empty text) and
        the text, dumped alone (the same escaping as inside the body), goes between."""
        template = self._templates.get((index, with_usage))
        if template is None:
            key = f'"{self._TEXT_KEY}":'
            head, _, tail = dump(self._text_body(index, with_usage)).partition(key + '""')
            template = self._templates[(index, with_usage)] = (head + key, tail)
        return template[0] + pydantic_core.to_json(text).decode() + template[1]

    def _text_only(self, delta: CompletionDelta) -> bool:
        """Whether `delta`'s chunk carries its text alone (no finish, logprobs or token ids): a
        `_text_chunk` unless the API adds more (echo, tool calls)."""
        return bool(delta.text) and delta.finish_reason is None and delta.prompt_logprobs is None \
            and self.top_n is None and not self.extras.token_ids

    _TEXT_KEY = ""  # the key whose value is the text in `_text_body` (the first such key in its JSON)

    def _text_body(self, index: int, with_usage: bool) -> dict[str, Any]:
        raise NotImplementedError


def dump(body: Any) -> str:
    """A stream chunk built as plain dicts (keys in the response model's field order, exactly the
    fields the model would have set) as JSON: pydantic-core's serializer with `model_dump_json`'s
    options (compact, UTF-8 unescaped, non-finite floats as null), so the bytes are the models' without
    building a model per chunk, token and top-logprob entry (tests/openai_api/test_chunk_bytes.py)."""
    return pydantic_core.to_json(body, inf_nan_mode="null").decode()


def _top_texts(entry: TokenLogprob) -> list[str | None]:
    return list(entry.top_texts) if entry.top_texts is not None else [None] * len(entry.top)


class CompletionBuilder(_Builder):
    """`/v1/completions`: `text_completion` chunks and response, completions-shaped logprobs. With `echo`
    each choice starts with its prompt (text unless return_token_ids, and the prompt's logprobs: the
    first token's null); with echo and max_tokens 0 the prompt is all it shows, as vLLM."""

    def shown(self, prompt_index: int, delta: CompletionDelta) -> tuple[bool, str, dict[str, list[Any]] | None] | None:
        """Record `delta`; what its stream chunk shows (first of its choice, text, logprobs), or None when
        it carries nothing (text held back, no logprobs)."""
        choice = self._record(prompt_index, delta)
        first = not choice.started
        choice.started = True
        text, logprobs = self._shown(choice, prompt_index, delta, first)
        if not text and logprobs is None and delta.finish_reason is None \
                and not (self.extras.token_ids and delta.token_ids) and not (first and self.extras.echo):
            return None
        return first, text, logprobs

    _TEXT_KEY = "text"

    def chunk(self, prompt_index: int, delta: CompletionDelta, with_usage: bool) -> str | None:
        """One stream chunk for `delta`, or None when it carries nothing."""
        if self._text_only(delta) and not self.extras.echo:
            index = prompt_index * self.n + delta.index
            self.choices[index].started = True
            return self._text_chunk(index, delta.text, with_usage)  # the chunk below, from its template
        shown = self.shown(prompt_index, delta)
        if shown is None:
            return None
        first, text, logprobs = shown
        out = {"index": self.index(prompt_index, delta), "text": text, "logprobs": logprobs,
               "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}  # CompletionChoice
        if self.extras.token_ids:
            out["token_ids"] = list(delta.token_ids)
        if first and (self.extras.echo or self.extras.token_ids):
            out["prompt_token_ids"] = list(self.prompts[prompt_index].token_ids)  # vLLM: on echo, or when asked
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [out]}  # CompletionResponse: system_fingerprint, then usage
        self._stamp(body, delta.finish_reason is not None, with_usage)
        if with_usage:
            body["usage"] = None
        return dump(body)

    def _text_body(self, index: int, with_usage: bool) -> dict[str, Any]:
        out = {"index": index, "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None}
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [out]}
        if with_usage:
            body["usage"] = None
        return body

    def add(self, prompt_index: int, delta: CompletionDelta) -> None:
        """Fold `delta` into the final response."""
        choice = self._record(prompt_index, delta)
        first = not choice.started
        choice.started = True
        text, logprobs = self._shown(choice, prompt_index, delta, first)
        choice.text.append(text)
        choice.token_ids.extend(delta.token_ids)
        if logprobs is not None:
            whole = choice.completion_logprobs
            if whole is None:
                choice.completion_logprobs = logprobs
            else:
                for name, values in logprobs.items():
                    whole[name] += values

    def response(self) -> str:
        choices = [p.CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason,
                                      logprobs=p.CompletionLogprobs.model_validate(c.completion_logprobs)
                                      if self.top_n is not None and c.completion_logprobs is not None else None,
                                      token_ids=self._ids(c.token_ids), prompt_logprobs=c.prompt_logprobs,
                                      prompt_token_ids=self._ids(self.prompts[i // self.n].token_ids)
                                      if self.prompts else None)
                   for i, c in enumerate(self.choices)]
        return str(p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                        system_fingerprint=self.extras.fingerprint, usage=self.usage.info(),
                                        kv_transfer_params=self.kv_transfer_params).model_dump_json())

    def usage_chunk(self) -> str:
        return self._dump(p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                               system_fingerprint=self.extras.fingerprint,
                                               usage=self.usage.info()))

    def _shown(self, choice: _Choice, prompt_index: int, delta: CompletionDelta,
               first: bool) -> tuple[str, dict[str, list[Any]] | None]:
        """The text and logprobs `delta` adds to its choice: the prompt's first with echo."""
        echo, echo_only = self.extras.echo, self.extras.echo_only
        if echo_only and not first:
            return "", None
        text = "" if echo_only else delta.text
        entries: list[tuple[int, TokenLogprob | None]] = []
        if first and echo:
            prompt = self.prompts[prompt_index]
            if not self.extras.token_ids:
                text = prompt.text + text
            if self.top_n is not None:
                ids = prompt.token_ids
                entries += [(ids[0], None)] if ids else []
                entries += [(e.token_id, e) for e in delta.prompt_logprobs or []]
        if self.top_n is None or (delta.logprobs is None and not entries):
            return text, None
        if not echo_only:
            entries += [(e.token_id, e) for e in delta.logprobs or []]
        return text, self._logprobs(choice, entries)

    def _logprobs(self, choice: _Choice, entries: list[tuple[int, TokenLogprob | None]]) -> dict[str, list[Any]]:
        """vLLM's completions logprobs (CompletionLogprobs' fields): per token its text, logprob and a dict
        of the token and the top-N (token first; null for the prompt's first token); offsets are the
        summed lengths of the tokens."""
        count = (self.top_n or 0) + 1
        as_ids = self.extras.as_token_ids
        offsets: list[int] = []
        logprobs: list[float | None] = []
        tokens: list[str] = []
        tops: list[dict[str, float] | None] = []
        for token_id, entry in entries:
            if entry is None:
                token = self._token(token_id, None)
                logprobs.append(None)
                tops.append(None)
            else:
                ranked = self.pieces.ranked(entry, count, as_ids)
                token = ranked[0][0][0]  # the entry's own token leads
                logprobs.append(ranked[0][1])
                tops.append({piece[0]: lp for piece, lp in ranked})
            tokens.append(token)
            offsets.append(choice.offset)
            choice.offset += len(token)
        return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": tops}


class ChatBuilder(_Builder):
    """`/v1/chat/completions`: `chat.completion.chunk`s (a role chunk first) and the response. `echo`
    (see `chat_echo`) starts every choice's content: its own chunk after the role chunks, as vLLM."""

    def __init__(self, response_id: str, model: str, n: int, num_prompts: int, texts: TokenTexts,
                 top_n: int | None, echo: str = "", extras: Extras | None = None) -> None:
        super().__init__(response_id, model, n, num_prompts, texts, top_n, extras)
        self.echo = echo

    def role_chunks(self, with_usage: bool) -> list[str]:
        """The first chunk of every choice: `{"role": "assistant", "content": ""}`, as OpenAI sends it
        (with the prompt's ids for return_token_ids, as vLLM); then the echoed content's, if any."""
        chunks = []
        for index in range(len(self.choices)):
            out = p.ChatChunkChoice(index=index, delta=p.DeltaMessage(role="assistant", content=""),
                                    logprobs=None, finish_reason=None)
            body = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[out])
            if self.extras.token_ids and self.prompts:
                body.prompt_token_ids = self.prompts[0].token_ids
            chunks.append(self._dump(body, with_usage))
        for index in range(len(self.choices) if self.echo else 0):
            out = p.ChatChunkChoice(index=index, delta=p.DeltaMessage(content=self.echo), logprobs=None,
                                    finish_reason=None)
            chunks.append(self._chunk([out], with_usage))
        return chunks

    def shown(self, prompt_index: int, delta: CompletionDelta) -> tuple[
            int, p.DeltaMessage | None, str | None, dict[str, list[dict[str, Any]]] | None] | None:
        """Record `delta`; what its stream chunk shows (choice index, the tool-call parser's message or
        None for the text as content, finish reason, logprobs), or None when it carries nothing."""
        self._record(prompt_index, delta)
        return self._shown(prompt_index, delta, self._logprobs(delta))

    def _shown(self, prompt_index: int, delta: CompletionDelta, logprobs: LogprobsT) -> tuple[
            int, p.DeltaMessage | None, str | None, LogprobsT] | None:
        """`shown` with the delta recorded and its logprobs (None: none asked) in whatever form."""
        ids = self.extras.token_ids and bool(delta.token_ids)
        if not delta.text and logprobs is None and delta.finish_reason is None and not ids:
            return None
        index = self.index(prompt_index, delta)
        calls = self.tool_calls[index] if self.tool_calls else None
        if calls is None:
            return index, None, delta.finish_reason, logprobs
        message = calls.delta(delta.text, finished=delta.finish_reason is not None)  # content and call pieces
        if message.content is None and message.tool_calls is None and logprobs is None \
                and delta.finish_reason is None and not ids:
            return None
        return index, message, calls.finish_reason(delta.finish_reason), logprobs

    def chunk(self, prompt_index: int, delta: CompletionDelta, with_usage: bool) -> str | None:
        """One stream chunk for `delta`, or None when it carries nothing. Its logprobs are JSON text
        (`_logprobs_json`), put in the place of the `"logprobs":null` the rest is dumped with: a JSON
        string escapes its quotes, so that text only occurs as the choice's key and its null value."""
        if self._text_only(delta) and not self.tool_calls:
            return self._text_chunk(prompt_index * self.n + delta.index, delta.text, with_usage)  # as below
        self._record(prompt_index, delta)
        shown = self._shown(prompt_index, delta, self._logprobs_json(delta))
        if shown is None:
            return None
        index, message, finish_reason, logprobs = shown
        if message is not None:
            content = message.model_dump(exclude_unset=True)
        else:
            content = {"content": delta.text} if delta.text else {}  # DeltaMessage
        out = {"index": index, "delta": content, "logprobs": None, "finish_reason": finish_reason}  # ChatChunkChoice
        if delta.finish_reason is not None:
            out["stop_reason"] = delta.stop_reason
        if self.extras.token_ids:
            out["token_ids"] = list(delta.token_ids)
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [out]}  # ChatCompletionChunk: usage, then system_fingerprint
        if with_usage:
            body["usage"] = None
        self._stamp(body, delta.finish_reason is not None, with_usage)
        if logprobs is None:
            return dump(body)
        return dump(body).replace('"logprobs":null', '"logprobs":' + logprobs, 1)

    _TEXT_KEY = "content"

    def _text_body(self, index: int, with_usage: bool) -> dict[str, Any]:
        out = {"index": index, "delta": {"content": ""}, "logprobs": None, "finish_reason": None}
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [out]}
        if with_usage:
            body["usage"] = None
        return body

    def _chunk(self, choices: list[p.ChatChunkChoice], with_usage: bool) -> str:
        body = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        return self._dump(body, with_usage)

    def add(self, prompt_index: int, delta: CompletionDelta) -> None:
        choice = self._record(prompt_index, delta)
        choice.text.append(delta.text)
        choice.token_ids.extend(delta.token_ids)
        logprobs = self._logprobs(delta)
        if logprobs is not None:
            if choice.chat_logprobs is None:
                choice.chat_logprobs = []
            choice.chat_logprobs.extend(logprobs["content"])

    def with_tool_calls(self, make: Callable[[], tools.ToolCalls] | None) -> ChatBuilder:
        """Parse each choice's text into tool calls (tools.py) with a `ToolCalls` from `make`."""
        self.tool_calls = [make() for _ in self.choices] if make is not None else []
        return self

    def _message(self, index: int, text: str) -> tuple[p.ChatMessageOut, str | None]:
        reason = self.choices[index].finish_reason
        if not self.tool_calls:
            return p.ChatMessageOut(content=text), reason
        calls = self.tool_calls[index]
        return calls.message(text), calls.finish_reason(reason)

    def response(self) -> str:
        messages = [self._message(i, "".join(c.text)) for i, c in enumerate(self.choices)]
        if self.echo:  # vLLM's chat echo: the last message's content before each choice's own
            for message, _ in messages:
                message.content = self.echo + (message.content or "")
        choices = [p.ChatChoice(index=i, message=messages[i][0],
                                finish_reason=messages[i][1], stop_reason=c.stop_reason,
                                logprobs=(p.ChatLogprobs.model_validate({"content": c.chat_logprobs or []})
                                          if self.top_n is not None else None),
                                token_ids=self._ids(c.token_ids))
                   for i, c in enumerate(self.choices)]
        return str(p.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices,
            system_fingerprint=self.extras.fingerprint, usage=self.usage.info(),
            prompt_logprobs=self.choices[0].prompt_logprobs if self.choices else None,
            prompt_token_ids=self._ids(self.prompts[0].token_ids) if self.prompts else None,
            kv_transfer_params=self.kv_transfer_params).model_dump_json())

    def usage_chunk(self) -> str:
        body = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                     usage=self.usage.info(), system_fingerprint=self.extras.fingerprint)
        return self._dump(body)

    def _logprobs(self, delta: CompletionDelta) -> dict[str, list[dict[str, Any]]] | None:
        """ChatLogprobs' fields for `delta`'s tokens, or None when no logprobs were asked."""
        if self.top_n is None or delta.logprobs is None:
            return None
        return {"content": [self._chat_token(entry) for entry in delta.logprobs]}

    def _logprobs_json(self, delta: CompletionDelta) -> str | None:
        """`_logprobs(delta)` as `dump` writes it, from the JSON around each logprob cached per token
        (`TokenPieces.json`): the logprobs, the only text not cached, are dumped in one call (pydantic-core
        writes a float without a comma, so the list splits at commas) and go between."""
        entries = delta.logprobs
        if self.top_n is None or entries is None:
            return None
        if not entries:
            return '{"content":[]}'
        as_ids = self.extras.as_token_ids
        count = self.top_n
        pieces = self.pieces
        parts: list[str] = []  # the text before and after each of logprobs, in turn
        logprobs: list[float] = []
        before = '{"content":['
        for entry in entries:
            token = self._token(entry.token_id, entry.text)
            own = pieces.json(token)  # the first row's too: ranked() leads with the same token
            # with return_tokens_as_token_ids the token is "token_id:N" and its bytes are its text's
            tail = pieces.json(self._text(entry.token_id, entry.text)).entry_tail if as_ids else own.entry_tail
            parts += (before + own.head, tail)
            logprobs.append(finite(entry.logprob))
            pieces.rows_json(entry, own, count, as_ids, parts, logprobs)
            before = "]},"
        texts = dump(logprobs)[1:-1].split(",")
        out = [""] * (3 * len(texts) + 1)
        out[0:-1:3] = parts[::2]
        out[1::3] = texts
        out[2::3] = parts[1::2]
        out[-1] = "]}]}"
        return "".join(out)

    def _chat_token(self, entry: TokenLogprob) -> dict[str, Any]:
        """vLLM's chat logprob (ChatTokenLogprob's fields): the first top_logprobs of the token then the
        top-N by rank; the token's `bytes` are the UTF-8 of its text (not of "token_id:N"), the
        alternatives' of what they show (TopLogprob's fields)."""
        as_ids = self.extras.as_token_ids
        ranked = self.pieces.ranked(entry, self.top_n or 0, as_ids)
        top = [{"token": token, "logprob": lp, "bytes": data} for (token, data), lp in ranked]
        if ranked and not as_ids:
            token, data = ranked[0][0]  # the entry's own token leads the top
        else:
            token = self._token(entry.token_id, entry.text)
            data = self.pieces.of(entry.token_id, entry.text, False)[1]  # the text's bytes, not "token_id:N"'s
        return {"token": token, "logprob": finite(entry.logprob), "bytes": data, "top_logprobs": top}
