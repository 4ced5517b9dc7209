"""OpenAI requests -> what the generation path takes; `CompletionDelta`s -> OpenAI bodies.

Requests: `served_model`, `unsupported`, `completion_prompts` / `chat_prompt` and `sampling_params` turn
a validated body into prompts and one `SamplingParams` (which validates itself with the contract's
rules, shared_runtime/contract.py, so both APIs share one set), and `field_names` says how to name a rejected field in the OpenAI request.

Responses: `ChoiceIndex` numbers choices (prompt index * n + completion index, as vLLM does for
batched prompts); `CompletionBuilder` and `ChatBuilder` turn deltas into stream chunks (one per delta
that carries something) or fold them into the final response, and sum usage over prompts (each prompt
counted once, every completion's tokens counted). `TokenTexts` decodes logprob tokens, cached per id.

Invariants:
- Concatenating a choice's chunk texts gives the non-streaming text (both come from the same deltas).
- Logprobs are finite in JSON (-inf, NaN -> -9999.0, as vLLM writes them).
- Chat `bytes` are a token's exact bytes for byte-level BPE (so concatenating them gives the UTF-8
  text even when a character spans tokens); otherwise the UTF-8 of the decoded token text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.chat_template import ChatOptions
from frontend_svc.openai import protocol as p
from frontend_svc.openai import structured, tools
from frontend_svc.openai.errors import ApiError, FieldNames, bad_request, model_not_found
from frontend_svc.outputs import CompletionDelta, TokenLogprob
from frontend_svc.processor import ChatPrompt, Prompt, PromptOptions
from frontend_svc.token_texts import TokenTexts as SharedTokenTexts
from shared_runtime.contract import SamplingParams
from shared_runtime.violations import ValidationError

MIN_LOGPROB = -9999.0
_TOKEN_CACHE_LIMIT = 1 << 16


# ---- requests ---------------------------------------------------------------------------------------


def served_model(requested: str | None, served: str) -> None:
    """404 model_not_found unless `requested` is the served model's name (or absent, as vLLM allows)."""
    if requested is not None and requested != served:
        raise model_not_found(requested)


def unsupported(request: p.CompletionRequest | p.ChatCompletionRequest) -> ApiError | None:
    """400 for a field tandem knows but does not implement (never silently ignored): one of vLLM's that
    tandem refuses (`protocol.REFUSED_*`) set to something other than null or vLLM's default, or one of
    OpenAI's below."""
    refused = p.REFUSED_COMPLETION if isinstance(request, p.CompletionRequest) else p.REFUSED_CHAT
    for name, default in refused.items():
        value = getattr(request, name)
        if value is not None and value != default:
            return bad_request(f"{name} is not supported by this server (only {json.dumps(default)} or null)",
                               name)
    if isinstance(request, p.CompletionRequest):
        if request.best_of is not None and request.best_of != request.n:
            return bad_request("best_of must equal n (beam-style best_of is not supported)", "best_of")
        return None
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
                    raise bad_request(f"content parts of type {part.type!r} are not supported (only 'text')",
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
    error = unsupported(chat)
    if error is not None:
        raise error
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


def sampling_params(request: p.CompletionRequest | p.ChatCompletionRequest) -> SamplingParams:
    """The request's `SamplingParams` (the one place OpenAI's sampling fields are mapped); raises
    ValidationError (bare field names, which `field_names` maps to OpenAI's)."""
    stop = request.stop
    return SamplingParams(
        temperature=_or(request.temperature, 1.0),
        top_p=_or(request.top_p, 1.0),
        top_k=_or(request.top_k, 0),
        min_p=_or(request.min_p, 0.0),
        seed=request.seed,
        max_tokens=max_tokens_of(request),
        min_tokens=request.min_tokens,
        stop=[stop] if isinstance(stop, str) else stop or [],
        stop_token_ids=request.stop_token_ids or [],
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        presence_penalty=_or(request.presence_penalty, 0.0),
        frequency_penalty=_or(request.frequency_penalty, 0.0),
        repetition_penalty=_or(request.repetition_penalty, 1.0),
        logprobs=logprobs_of(request),
        n=request.n,
        skip_special_tokens=request.skip_special_tokens,
        logit_bias=_logit_bias(request.logit_bias),
        allowed_token_ids=request.allowed_token_ids or [],
        bad_words=request.bad_words or [],
        structured_outputs=structured.request_constraint(
            request, tools.constraint(request) if isinstance(request, p.ChatCompletionRequest) else None),
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
    """Token id -> its text (the tokenizer's `token_texts` cache) and exact bytes, decoded once per id (the
    caches are bounded)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: SharedTokenTexts = tokenizer.token_texts  # shared with the output processor
        self._bytes: dict[int, list[int]] = {}
        self._byte_level = _byte_decoder() if _is_byte_level(tokenizer) else None

    def text(self, token_id: int) -> str:
        return self._texts.text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        cached = self._bytes.get(token_id)
        if cached is None:
            if len(self._bytes) >= _TOKEN_CACHE_LIMIT:
                self._bytes.clear()
            cached = self._bytes[token_id] = self._exact_bytes(token_id)
        return cached

    def _exact_bytes(self, token_id: int) -> list[int]:
        table = self._byte_level
        if table is not None:
            piece = self._tokenizer.backend.id_to_token(token_id)
            if piece is not None and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self.text(token_id).encode("utf-8", "replace"))


def _is_byte_level(tokenizer: Any) -> bool:
    decoder = getattr(getattr(tokenizer, "backend", None), "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    completion_logprobs: p.CompletionLogprobs | None = None
    chat_logprobs: list[p.ChatTokenLogprob] | None = None
    offset: int = 0  # characters of text before the next token (completions text_offset)
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
    """What both endpoints share: ids, choice numbering, per-choice state, usage."""

    def __init__(self, response_id: str, model: str, n: int, num_prompts: int, texts: TokenTexts,
                 top_n: int | None) -> None:
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.n = n
        self.texts = texts
        self.top_n = top_n  # None: no logprobs asked
        self.choices = [_Choice() for _ in range(n * num_prompts)]
        self.usage = _Usage()
        self.tool_calls: list[tools.ToolCalls] = []  # chat: one per choice while tool calls are parsed

    def index(self, prompt_index: int, delta: CompletionDelta) -> int:
        return prompt_index * self.n + delta.index

    def _record(self, prompt_index: int, delta: CompletionDelta) -> _Choice:
        choice = self.choices[self.index(prompt_index, delta)]
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason
            self.usage.add(prompt_index, delta)
        return choice

    @staticmethod
    def _dump(chunk: Any, with_usage: bool = False) -> str:
        """A stream chunk: fields the builder set (nulls included) and `object`, nothing else; with
        `with_usage` (stream_options.include_usage) also `"usage": null`, as OpenAI sends it."""
        chunk.object = chunk.object  # an explicit assignment marks the constant as set
        if with_usage:
            chunk.usage = None
        return str(chunk.model_dump_json(exclude_unset=True))


class CompletionBuilder(_Builder):
    """`/v1/completions`: `text_completion` chunks and response, completions-shaped logprobs."""

    def chunk(self, prompt_index: int, delta: CompletionDelta, with_usage: bool) -> str | None:
        """One stream chunk for `delta`, or None when it carries nothing (text held back, no logprobs)."""
        choice = self._record(prompt_index, delta)
        logprobs = self._logprobs(choice, delta)
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return None
        out = p.CompletionChoice(index=self.index(prompt_index, delta), text=delta.text, logprobs=logprobs,
                                 finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
        body = p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[out])
        return self._dump(body, with_usage)

    def add(self, prompt_index: int, delta: CompletionDelta) -> None:
        """Fold `delta` into the final response."""
        choice = self._record(prompt_index, delta)
        choice.text.append(delta.text)
        logprobs = self._logprobs(choice, delta)
        if logprobs is not None:
            whole = choice.completion_logprobs
            if whole is None:
                choice.completion_logprobs = logprobs
            else:
                whole.text_offset += logprobs.text_offset
                whole.token_logprobs += logprobs.token_logprobs
                whole.tokens += logprobs.tokens
                whole.top_logprobs += logprobs.top_logprobs

    def response(self) -> str:
        choices = [p.CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason,
                                      logprobs=c.completion_logprobs if self.top_n is not None else None)
                   for i, c in enumerate(self.choices)]
        return str(p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                        usage=self.usage.info()).model_dump_json())

    def usage_chunk(self) -> str:
        return self._dump(p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                               usage=self.usage.info()))

    def _logprobs(self, choice: _Choice, delta: CompletionDelta) -> p.CompletionLogprobs | None:
        if self.top_n is None or delta.logprobs is None:
            return None
        out = p.CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])  # all "set"
        for entry in delta.logprobs:
            token = entry.text if entry.text is not None else self.texts.text(entry.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(finite(entry.logprob))
            out.text_offset.append(choice.offset)
            choice.offset += len(token)
            top = {self.texts.text(tid): finite(lp) for tid, lp in entry.top[: self.top_n]}
            top.setdefault(token, finite(entry.logprob))  # OpenAI: the sampled token is always there
            out.top_logprobs.append(top)
        return out


class ChatBuilder(_Builder):
    """`/v1/chat/completions`: `chat.completion.chunk`s (a role chunk first) and the response. `echo`
    (see `chat_echo`) starts every choice's content: its own chunk after the role chunks, as vLLM."""

    def __init__(self, response_id: str, model: str, n: int, num_prompts: int, texts: TokenTexts,
                 top_n: int | None, echo: str = "") -> None:
        super().__init__(response_id, model, n, num_prompts, texts, top_n)
        self.echo = echo

    def role_chunks(self, with_usage: bool) -> list[str]:
        """The first chunk of every choice: `{"role": "assistant", "content": ""}`, as OpenAI sends it;
        then the echoed content's, if any."""
        chunks = []
        for index in range(len(self.choices)):
            out = p.ChatChunkChoice(index=index, delta=p.DeltaMessage(role="assistant", content=""),
                                    logprobs=None, finish_reason=None)
            chunks.append(self._chunk([out], with_usage))
        for index in range(len(self.choices) if self.echo else 0):
            out = p.ChatChunkChoice(index=index, delta=p.DeltaMessage(content=self.echo), logprobs=None,
                                    finish_reason=None)
            chunks.append(self._chunk([out], with_usage))
        return chunks

    def chunk(self, prompt_index: int, delta: CompletionDelta, with_usage: bool) -> str | None:
        self._record(prompt_index, delta)
        logprobs = self._logprobs(delta)
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return None
        index = self.index(prompt_index, delta)
        calls = self.tool_calls[index] if self.tool_calls else None
        if calls is not None:  # tool calling: content and tool-call pieces out of the text
            message = calls.delta(delta.text, finished=delta.finish_reason is not None)
            if message.content is None and message.tool_calls is None and logprobs is None \
                    and delta.finish_reason is None:
                return None
            finish_reason = calls.finish_reason(delta.finish_reason)
        else:
            message = p.DeltaMessage(content=delta.text) if delta.text else p.DeltaMessage()
            finish_reason = delta.finish_reason
        out = p.ChatChunkChoice(index=index, delta=message, logprobs=logprobs, finish_reason=finish_reason)
        if delta.finish_reason is not None:
            out.stop_reason = delta.stop_reason
        return self._chunk([out], with_usage)

    def _chunk(self, choices: list[p.ChatChunkChoice], with_usage: bool) -> str:
        body = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        return self._dump(body, with_usage)

    def add(self, prompt_index: int, delta: CompletionDelta) -> None:
        choice = self._record(prompt_index, delta)
        choice.text.append(delta.text)
        logprobs = self._logprobs(delta)
        if logprobs is not None and logprobs.content is not None:
            if choice.chat_logprobs is None:
                choice.chat_logprobs = []
            choice.chat_logprobs.extend(logprobs.content)

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
                                logprobs=(p.ChatLogprobs(content=c.chat_logprobs or [])
                                          if self.top_n is not None else None))
                   for i, c in enumerate(self.choices)]
        return str(p.ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                            choices=choices, usage=self.usage.info()).model_dump_json())

    def usage_chunk(self) -> str:
        body = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                     usage=self.usage.info())
        return self._dump(body)

    def _logprobs(self, delta: CompletionDelta) -> p.ChatLogprobs | None:
        if self.top_n is None or delta.logprobs is None:
            return None
        return p.ChatLogprobs(content=[self._token(entry) for entry in delta.logprobs])

    def _token(self, entry: TokenLogprob) -> p.ChatTokenLogprob:
        texts = self.texts
        token = entry.text if entry.text is not None else texts.text(entry.token_id)
        top = [p.TopLogprob(token=texts.text(tid), logprob=finite(lp), bytes=texts.bytes(tid))
               for tid, lp in entry.top[: self.top_n]]
        return p.ChatTokenLogprob(token=token, logprob=finite(entry.logprob), bytes=texts.bytes(entry.token_id),
                                  top_logprobs=top)

