"""Anthropic Messages API request bodies (pydantic), as vLLM 0.32's AnthropicMessagesRequest takes them.

Unknown fields are refused (400 naming the field), never ignored. A field or block type that Anthropic or
vLLM defines and tandem does not implement is declared here so that it is refused by name when set:
`REFUSED` lists the request fields (refused unless absent, null or the default given there), and
`UnsupportedBlock` the content block types (refused wherever they appear, convert.py).

Accepted with no effect, as vLLM: `metadata` (Anthropic's abuse-tracking `user_id`), `cache_control` on
blocks, tools and the request (a prompt-caching hint: tandem's prefix cache is automatic), `is_error` on a tool result
(chat templates have no place for it), `service_tier` (one tier), `strict` on a tool.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared_runtime import limits


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None  # refused unless null or empty (convert.py)


class UnsupportedBlock(BaseModel):
    """A content block tandem does not take (images and documents: no multimodal model; thinking blocks: no
    reasoning parser; vLLM's tool-set changes): refused by its path, whatever its fields."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "thinking", "redacted_thinking", "server_tool_use",
                  "web_search_tool_result", "tool_reference", "tool_addition", "tool_removal", "container_upload"]


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


ResultPart = Annotated[TextBlock | UnsupportedBlock, Field(discriminator="type")]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | UnsupportedBlock, Field(discriminator="type")]


class Message(_Model):
    """A turn. `system` is vLLM's extension (an inline system message, kept in place)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(_Model):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None
    defer_loading: bool | None = None  # vLLM's; refused unless null or false (convert.py)


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(_Model):
    type: Literal["json_schema"] = "json_schema"
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # the template's reasoning_effort
    format: JsonOutputFormat | None = None  # structured output (a JSON schema)


class Thinking(_Model):
    """Only `{"type": "disabled"}` is honoured (the template's reasoning_effort "none", as vLLM)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class _Prompt(_Model):
    """What both routes render: the system prompt, the messages, the tools."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=limits.MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra
    # Anthropic's, refused unless absent or null (REFUSED)
    mcp_servers: Any = None
    context_management: Any = None


class MessagesRequest(_Prompt):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None  # Anthropic's SDK 2.x sends these three as extra body fields:
    top_p: float | None = None  # the JSON is the same
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # automatic prompt caching: tandem's prefix cache always is
    service_tier: Literal["auto", "standard_only"] | None = None
    # Anthropic's and vLLM's, refused unless absent, null or vLLM's default (REFUSED)
    container: Any = None
    inference_geo: Any = None
    cache_salt: Any = None
    watermarking: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None


class CountTokensRequest(_Prompt):
    """`POST /v1/messages/count_tokens`."""


# field -> the one value (besides null) it may have: anything else is a 400 naming the field
REFUSED: dict[str, object] = {
    "mcp_servers": None, "context_management": None, "container": None, "inference_geo": None,
    "cache_salt": None, "watermarking": None, "kv_transfer_params": None, "ec_transfer_params": None,
    "vllm_xargs": None, "mm_payload": "tensors", "return_mm_kwargs": None,
}
