"""An Anthropic Messages request -> the chat completion that produces its answer (vLLM 0.32's mapping).

The chat request then goes through the chat path unchanged (template, tools, sampling, bounds, errors),
so a request's prompt and greedy text are chat's on the same messages:

- `system` (a string, or text blocks joined with no separator) is a system message first; a system text
  block starting with "x-anthropic-billing-header" (Claude Code's per-request attribution) is dropped,
  as vLLM drops it, so the prompt prefix stays cacheable. An inline `system` message (vLLM's extension)
  stays where it is.
- A message's text blocks are its content (one block: a string; several: text parts, which the chat
  path joins with newlines); an assistant's `tool_use` blocks are its `tool_calls` (arguments as JSON);
  a user's `tool_result` block is a `tool` message (text parts joined with newlines) placed before
  what remains of that user message, which is dropped when nothing remains.
- `max_tokens` -> max_tokens, `stop_sequences` -> stop, temperature/top_p/top_k as they are,
  `tools` -> function tools (`input_schema` the parameters, "type": "object" added when missing),
  `tool_choice` auto/any/none/tool -> "auto"/"required"/"none"/the named function (tools without a
  tool_choice: "auto"), `disable_parallel_tool_use` -> parallel_tool_calls false,
  `output_config.format` -> response_format json_schema, `output_config.effort` -> the template's
  reasoning_effort, `thinking: {"type": "disabled"}` -> reasoning_effort "none".

Refused (400 naming the field, as Anthropic's own paths): the fields of `protocol.REFUSED` when set,
content blocks other than text / tool_use / tool_result, a `tool_use` in a user message or a
`tool_result` in an assistant one, `citations`, `defer_loading`, thinking enabled or adaptive.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic

from frontend_svc.anthropic import protocol as ap
from frontend_svc.openai import bodies
from frontend_svc.openai import protocol as p
from frontend_svc.openai.errors import ApiError, FieldNames, bad_request, from_pydantic
from shared_runtime.violations import ValidationError

BILLING_HEADER = "x-anthropic-billing-header"
# the chat request's field names as the Messages request spells them (400s name what the client sent)
RENAMES = {"chat.messages": "messages", "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
           "response_format": "output_config.format", "response_format.json_schema.schema": "output_config.format",
           "structured_outputs": "output_config.format", "tool_choice.function.name": "tool_choice.name",
           "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}
NAMES = FieldNames(RENAMES)


def unsupported(body: ap.MessagesRequest | ap.CountTokensRequest) -> ApiError | None:
    """400 naming the first refused field that is set (protocol.REFUSED), or thinking not disabled."""
    refused = {name: default for name, default in ap.REFUSED.items() if name in type(body).model_fields}
    error = bodies.refused_field(body, refused)
    if error is not None:
        return error
    if body.thinking is not None and body.thinking.type != "disabled":
        return bad_request(f"thinking of type {body.thinking.type!r} is not supported by this server (no reasoning "
                           'parser; only {"type": "disabled"})', "thinking.type")
    for i, tool in enumerate(body.tools or []):
        if tool.defer_loading:
            return bad_request("defer_loading is not supported by this server", f"tools.[{i}].defer_loading")
    return None


def to_chat(body: ap.MessagesRequest | ap.CountTokensRequest) -> p.ChatCompletionRequest:
    """The chat completion that produces this message (every honoured field mapped here)."""
    messages = _system(body.system) + _messages(body.messages)
    chat: dict[str, Any] = {"model": body.model, "messages": messages,
                            "chat_template_kwargs": _template_kwargs(body)}
    if isinstance(body, ap.MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k, stream=bool(body.stream))
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "json_schema", "schema": fmt.schema_}}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description, "strict": tool.strict,
            "parameters": {"type": "object", **tool.input_schema}}} for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice.name is required when type is 'tool'", "tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    try:
        return p.ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except pydantic.ValidationError as exc:
        error = from_pydantic(exc)
        raise NAMES.error(ValidationError.single(error.param or "messages", error.message)) from None


def _template_kwargs(body: ap.MessagesRequest | ap.CountTokensRequest) -> dict[str, Any] | None:
    """chat_template_kwargs with the reasoning effort of `output_config.effort` or a disabled `thinking`
    (and `enable_thinking` from it, as the chat path derives it), which win over the same names there."""
    kwargs = dict(body.chat_template_kwargs or {})
    effort: str | None = body.output_config.effort if body.output_config is not None else None
    if effort is None and body.thinking is not None and body.thinking.type == "disabled":
        effort = "none"
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs or None


def _system(system: str | list[ap.TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    else:
        for j, block in enumerate(system):
            _no_citations(block, f"system.[{j}]")
        text = "".join(b.text for b in system if b.text and not b.text.startswith(BILLING_HEADER))
    return [{"role": "system", "content": text}] if text else []


def _messages(messages: list[ap.Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            where = f"messages.[{i}].content.[{j}]"
            if isinstance(block, ap.TextBlock):
                _no_citations(block, where)
                if block.text and not (message.role == "system" and block.text.startswith(BILLING_HEADER)):
                    texts.append(block.text)
            elif isinstance(block, ap.ToolUseBlock):
                if message.role != "assistant":
                    raise bad_request("tool_use blocks belong in assistant messages", f"{where}.type")
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ap.ToolResultBlock):
                if message.role != "user":
                    raise bad_request("tool_result blocks belong in user messages", f"{where}.type")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, where)})
            else:
                raise bad_request(f"content blocks of type {block.type!r} are not supported by this server (only "
                                  "text, tool_use and tool_result)", f"{where}.type")
        if message.role == "system":
            if texts:
                out.append({"role": "system", "content": "".join(texts)})
            continue
        entry: dict[str, Any] = {"role": message.role}
        if texts:
            entry["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
        if calls:
            entry["tool_calls"] = calls
        if message.role == "assistant" or "content" in entry:
            out.append(entry)
    return out


def _result_text(block: ap.ToolResultBlock, where: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    texts = []
    for k, part in enumerate(block.content):
        if not isinstance(part, ap.TextBlock):
            raise bad_request(f"tool_result content of type {part.type!r} is not supported by this server (only "
                              "text)", f"{where}.content.[{k}].type")
        _no_citations(part, f"{where}.content.[{k}]")
        texts.append(part.text)
    return "\n".join(texts)


def _no_citations(block: ap.TextBlock, where: str) -> None:
    if block.citations:
        raise bad_request("citations are not supported by this server", f"{where}.citations")
