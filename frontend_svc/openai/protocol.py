"""OpenAI request and response bodies as pydantic models (the library validates them, not hand code).

Requests follow OpenAI's API reference plus vLLM's extra fields (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, `priority`, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`,
`add_special_tokens`, the chat template extras, ...). Decisions (docs/openai.md):
- Every field of vLLM's CompletionRequest / ChatCompletionRequest is either honoured with vLLM's
  semantics or refused: `REFUSED_COMPLETION` / `REFUSED_CHAT` list the refused ones with vLLM's default
  (sending the default, or null, is accepted: it asks for nothing). tests/openai_api/test_vllm_fields.py
  enumerates vLLM's fields (a recorded fixture) against these models.
- Fields unknown to vLLM too are ignored, as vLLM does and as the OpenAI SDKs expect of compatible
  servers (their `extra_body` is how clients send vendor fields); `best_of` other than n, `tools`,
  `functions` and a non-text `response_format` are rejected with 400 naming the field (convert.py).
- Types are coerced as vLLM's pydantic models coerce them (pydantic's lax mode: `"0.5"` is a number,
  `10.0` and `"10"` are integers, `"true"` is a bool; `2.5` for an integer is a 400), except `prompt`,
  which stays strict: `["1", "2"]` is two text prompts, as vLLM's smart union reads it, never token ids.
- Value ranges are checked by `SamplingParams` and the processor (one source of truth for both APIs);
  this module only checks shapes, and bounds the size of `logit_bias` while parsing (a body of a
  million entries is refused before anything walks it on the event loop).

Responses are validated models too, dumped in full. Stream chunks are these models with
`exclude_unset=True` (the fields the builder sets, nulls included, appear — e.g. `"finish_reason": null` —
and untouched defaults such as `usage` without `include_usage` do not); the per-delta chunks are built
as plain dicts in the models' field order instead (convert.dump, no model per token), held to the
models' bytes by tests/openai_api/test_chunk_bytes.py.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from frontend_svc.chat_template import MAX_CHAT_TEMPLATE_CHARS
from shared_runtime import limits


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # Fields vLLM types as optional where tandem's type is not: an explicit null means the default, as
    # there (tests/openai_api/test_vllm_fields.py checks every field vLLM accepts null for).
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.NULL_IS_DEFAULT:
            nulls = [name for name in cls.NULL_IS_DEFAULT if name in data and data[name] is None]
            if nulls:
                data = {key: value for key, value in data.items() if key not in nulls}
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text, json_object, or json_schema (with `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs` extra field (exactly one constraint)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Request):
    """Fields both generation endpoints share."""

    NULL_IS_DEFAULT = frozenset({"stream"})

    model: str | None = None  # None: the served model (vLLM); any other name is 404 model_not_found
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=limits.MAX_LOGIT_BIAS)
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # vLLM's extra token filters and prompt shaping (honoured: convert.py, frontend_svc/processor.py)
    allowed_token_ids: list[int] | None = Field(default=None, max_length=limits.MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] | None = Field(default=None, max_length=limits.MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None  # the response id's suffix when no X-Request-Id header is sent (vLLM)
    # Fields vLLM knows that tandem does not implement: captured here (any JSON) so that `unsupported`
    # refuses a value other than vLLM's default by name; `REFUSED` lists them with that default.
    use_beam_search: Any = None
    length_penalty: Any = None
    watermarking: Any = None
    spaces_between_special_tokens: Any = None
    prompt_logprobs: int | None = None  # top-N per prompt token (the first token's entry is null)
    return_tokens_as_token_ids: bool | None = False  # logprob tokens as "token_id:N"
    return_token_ids: bool | None = False  # prompt_token_ids and token_ids in the response
    logprob_token_ids: Any = None
    session_id: Any = None
    return_token_offsets: Any = None
    routed_experts_prompt_start: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None  # P/D driven from outside (openai/kv_transfer.py)
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream_interval: int | None = None  # tokens per streamed chunk, at least the server's (output_processor.py)
    # Structured outputs (frontend_svc/openai/structured.py): OpenAI's and vLLM's spellings
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None


# vLLM's request fields tandem refuses (400 naming the field) unless absent, null or vLLM's default,
# which is what the value here is (a default means "off": accepting it changes nothing).
REFUSED_COMMON: dict[str, object] = {
    "use_beam_search": False, "length_penalty": 1.0, "watermarking": False,
    "spaces_between_special_tokens": True, "logprob_token_ids": None,
    "session_id": None, "return_token_offsets": False, "routed_experts_prompt_start": 0, "mm_payload": "tensors",
    "return_mm_kwargs": False, "cache_salt": None, "ec_transfer_params": None,
    "vllm_xargs": None, "repetition_detection": None, "thinking_token_budget": None,
}
REFUSED_COMPLETION: dict[str, object] = {**REFUSED_COMMON, "suffix": None,
                                         "prompt_embeds": None}
REFUSED_CHAT: dict[str, object] = {**REFUSED_COMMON, "return_prompt_text": False, "media_io_kwargs": None,
                                   "mm_processor_kwargs": None, "include_reasoning": True}


# Token ids first, members tried in order: a large list of ids validates in one pass, where pydantic's
# "smart" union mode tries every member, each with the GIL held (BENCHMARKS.md, "The HTTP edge ...").
# Strict members: lax mode would read ["1", "2"] as token ids, where vLLM's smart union keeps two text prompts.
CompletionPrompt = list[StrictInt] | list[list[StrictInt]] | StrictStr | list[StrictStr]


class CompletionRequest(_Sampling):
    """`POST /v1/completions`. `prompt`: a string, a list of strings, a list of token ids, or a list of
    token-id lists (a batch: choice index = prompt index * n + completion index, as vLLM numbers them)."""

    prompt: CompletionPrompt = Field(union_mode="left_to_right")
    max_tokens: int | None = 16  # OpenAI's default for completions; null fills the context window
    logprobs: int | None = None  # top-N per token, in the completions shape
    add_special_tokens: bool = True  # vLLM: e.g. BOS for a text prompt
    echo: bool | None = False  # the prompt before each choice's text (and its logprobs, prompt_logprobs)
    suffix: Any = None
    best_of: int | None = None
    prompt_embeds: Any = None


class FunctionCall(BaseModel):
    """A function call (request messages and responses): `arguments` is JSON text."""

    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first carries `id`, `type` and the name, later ones argument
    text to append (OpenAI's streaming shape)."""

    model_config = ConfigDict(extra="forbid")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`, rendered with the model's chat template."""

    NULL_IS_DEFAULT = frozenset({"stream", "n", "logprobs", "parallel_tool_calls"})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None  # wins over max_tokens; neither: fill the context window
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extra
    # vLLM's chat rendering extras (frontend_svc/chat_template.py)
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template adds them
    echo: bool = False  # prepend the last message's content when it is the response's role (vLLM)
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = Field(default=None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    # a template variable, as vLLM passes it (with enable_thinking unless chat_template_kwargs sets it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # refused unless vLLM's default (REFUSED_CHAT)
    include_reasoning: Any = None
    return_prompt_text: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    tools: list[Tool] | None = Field(default=None, max_length=limits.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None


class TokenizeCompletionRequest(_Request):
    """`POST /tokenize` with a prompt (vLLM's form): its ids, BOS and the like unless add_special_tokens is
    false."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    """`POST /tokenize` with messages (vLLM's form): the chat as /v1/chat/completions renders it. Every
    field is one of `ChatCompletionRequest`'s (same meaning) but `return_token_strs`."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = Field(default=None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: Any = None  # refused unless null (REFUSED_CHAT)
    mm_processor_kwargs: Any = None
    tools: list[Tool] | None = Field(default=None, max_length=limits.MAX_TOOLS)
    return_token_strs: bool | None = False


class DetokenizeRequest(_Request):
    """`POST /detokenize`: the text of `tokens`, special tokens kept (vLLM decodes with the tokenizer's
    defaults)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# ---- responses ---------------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """OpenAI's completions logprobs: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(_Response):
    """One token of a prompt position (vLLM's Logprob: keyed by the token id in the position's dict)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: the matched stop string or stop token id
    token_ids: list[int] | None = None  # vLLM extras: return_token_ids, prompt_logprobs
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill's kept K/V (openai/kv_transfer.py)


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(_Response):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM extra: return_token_ids


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extras
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill's kept K/V (openai/kv_transfer.py)


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM extra: return_token_ids


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None  # on the last chunk only, as vLLM
    prompt_token_ids: list[int] | None = None  # on the first chunk with return_token_ids


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # present (null unless asked for), as vLLM answers


class DetokenizeResponse(_Response):
    prompt: str


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM)
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
