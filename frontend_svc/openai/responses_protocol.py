"""The Responses API's request body (`POST /v1/responses`) as vLLM 0.32's ResponsesRequest takes it.

Every field of vLLM's model is here: honoured (frontend_svc/openai/responses.py maps the request onto a
chat completion, so the prompt, sampling and bounds are chat's), or captured as any JSON and refused
with a 400 naming it unless absent, null or vLLM's default (`REFUSED_RESPONSES`).
tests/openai_api/test_responses_fields.py enumerates vLLM's fields (a recorded fixture) against it.

Input items: `input` is a string (one user message) or a list of messages — `{"role", "content"}` with
content a string or a list of `input_text` / `output_text` parts, `"type": "message"` optional — where
an assistant message whose `status` is "in_progress" or "incomplete" last is continued (vLLM's partial
message completion). Other item types (function calls and their outputs, reasoning, images, files) are
a 400 naming `input`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from frontend_svc.openai.protocol import _Request
from shared_runtime import limits

# vLLM's fields tandem refuses (400 naming the field) unless absent, null or this default (vLLM's).
REFUSED_RESPONSES: dict[str, object] = {
    "max_tool_calls": None, "prompt": None, "include": None, "top_logprobs": 0, "truncation": "disabled",
    "tools": [], "watermarking": None, "session_id": None, "media_io_kwargs": None,
    "mm_processor_kwargs": None, "mm_payload": "tensors", "return_mm_kwargs": None, "cache_salt": None,
    "enable_response_messages": False, "previous_input_messages": None, "structured_outputs": None,
    "vllm_xargs": None, "kv_transfer_params": None, "ec_transfer_params": None,
}
TEXT_PARTS = ("input_text", "output_text")
PARTIAL = ("in_progress", "incomplete")  # an assistant message with this status last is continued


class InputPart(_Request):
    type: str
    text: str | None = None


class InputItem(_Request):
    """A message item (OpenAI's EasyInputMessage / ResponseInputMessage / ResponseOutputMessage)."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    status: str | None = None


class TextFormat(_Request):
    """`text.format`: "text", "json_object", or "json_schema" with the schema inline (not nested)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    """`POST /v1/responses` (text in, text out)."""

    input: str | list[InputItem]
    instructions: str | None = None  # a system message first
    max_output_tokens: int | None = None  # None: fill the context window (vLLM)
    model: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)  # echoed
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = Field(default=None, max_length=limits.MAX_LOGIT_BIAS)
    priority: int = 0
    request_id: str | None = None  # the response's id (vLLM; default "resp_<random>")
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning: Reasoning | None = None  # effort -> the template's reasoning_effort (vLLM); echoed
    text: TextConfig | None = None  # format -> structured output (response_format)
    stream: bool | None = False
    user: str | None = None  # no effect (vLLM); echoed
    # accepted with vLLM's effect (none without a store, tools or a reasoning parser), echoed
    store: bool | None = True  # vLLM (without VLLM_ENABLE_RESPONSES_API_STORE) stores nothing
    previous_response_id: str | None = None  # nothing is stored: 404, as vLLM
    background: bool | None = False  # needs a store: 400, as vLLM
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    parallel_tool_calls: bool | None = True
    tool_choice: Any = "auto"  # "auto" / "none" only (no tools): "none" in the response, as vLLM
    include_reasoning: bool = True
    prompt_cache_key: str | None = None  # vLLM ignores it too
    # refused unless vLLM's default (REFUSED_RESPONSES)
    max_tool_calls: Any = None
    prompt: Any = None
    include: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    tools: Any = None
    watermarking: Any = None
    session_id: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    cache_salt: Any = None
    enable_response_messages: Any = None
    previous_input_messages: Any = None
    structured_outputs: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
