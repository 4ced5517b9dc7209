"""Tool calling on /v1/chat/completions, with vLLM's semantics.

- `tools` go to the chat template (transformers' `apply_chat_template(tools=...)`), as OpenAI function
  definitions; assistant messages with `tool_calls` (arguments parsed from JSON text into objects, as
  vLLM hands them to templates) and `role: "tool"` messages with `tool_call_id` are accepted.
- `tool_choice` (default "auto" when tools are given, as OpenAI's):
  - "none": plain text; no calls are parsed.
  - a named function: the engine constrains the output to that function's `parameters` schema; the
    output is the call's arguments; `finish_reason` stays "stop" (OpenAI's, and vLLM's, behaviour).
  - "required": the engine constrains the output to a JSON array of `{"name", "parameters"}` objects,
    one per call, each item any of the tools (vLLM's schema; `parallel_tool_calls: false` allows one
    item); `finish_reason` "tool_calls".
  - "auto": the model writes calls in its own format and the server's `--tool-call-parser` (vLLM's
    flag; `hermes` here) takes them out of the text (tool_parsers.py); `finish_reason` "tool_calls" when
    it found one; with `parallel_tool_calls: false` only the first call is kept (vLLM's filter). Without
    a parser "auto" is a 400, as vLLM answers without --enable-auto-tool-choice.
- Streaming sends OpenAI's tool-call deltas: the first for a call carries `index`, `id`, `type` and the
  function's name with empty arguments, later ones pieces of the arguments (concatenated, they are the
  non-streaming `arguments`: both come from the same incremental parser).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from frontend_svc.openai import protocol as p
from frontend_svc.openai.errors import echo
from frontend_svc.openai.structured import schema_text
from frontend_svc.openai.tool_parsers import (
    TOOL_CALL_PARSER_NAMES,
    TOOL_CALL_PARSERS,
    RequiredParser,
    ToolEvent,
)
from shared_runtime.contract import StructuredOutputs
from shared_runtime.violations import ValidationError

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_choice_of(request: p.ChatCompletionRequest) -> str | p.NamedToolChoice:
    """The effective tool_choice: as given, else "auto" with tools and "none" without."""
    if request.tool_choice is not None:
        return request.tool_choice
    return "auto" if request.tools else "none"


def check(request: p.ChatCompletionRequest, parser: str | None) -> None:
    """400 for tool fields that cannot be honoured (raises ValidationError with the OpenAI field)."""
    if request.functions:
        raise ValidationError.single("functions", "the deprecated functions field is not supported; use tools")
    choice = tool_choice_of(request)
    if choice != "none" and not request.tools:
        raise ValidationError.single("tool_choice", "tool_choice needs tools")
    if isinstance(choice, p.NamedToolChoice) and _tool(request, choice.function.name) is None:
        raise ValidationError.single("tool_choice.function.name",
                                     f"no tool named {echo(choice.function.name)!r} in tools")
    if choice == "auto" and parser is None:
        raise ValidationError.single("tool_choice", '"auto" tool choice needs the server to run with '
                                                    f"--tool-call-parser ({', '.join(TOOL_CALL_PARSER_NAMES)})")


def constraint(request: p.ChatCompletionRequest) -> StructuredOutputs | None:
    """The engine constraint of a "required" or named tool choice (vLLM's schemas), else None."""
    choice = tool_choice_of(request)
    tools = request.tools or []
    if isinstance(choice, p.NamedToolChoice):
        tool = _tool(request, choice.function.name)
        assert tool is not None  # check() ran
        return StructuredOutputs(json=schema_text(tool.function.parameters or _EMPTY_PARAMETERS))
    if choice != "required":
        return None
    items = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": t.function.parameters or _EMPTY_PARAMETERS},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema_text(schema))


def template_tools(request: p.ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (OpenAI's shape), or None."""
    if not request.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def message_tool_calls(calls: list[p.ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's tool calls for the chat template: arguments as objects (vLLM parses them
    the same way; templates write them with `tojson`), kept as text when they are not JSON."""
    out = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.function.arguments)
        except (ValueError, RecursionError):  # not JSON, or nested too deeply to parse
            arguments = call.function.arguments
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out


def _tool(request: p.ChatCompletionRequest, name: str) -> p.Tool | None:
    return next((t for t in request.tools or [] if t.function.name == name), None)


# ---- responses ----------------------------------------------------------------------------------------


class _Parser(Protocol):
    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...


class _NamedParser:
    """tool_choice naming a function: the whole output is that call's arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> list[ToolEvent]:
        events = [] if self._started else [ToolEvent("name", self._name, 0)]
        self._started = True
        return events + ([ToolEvent("args", text, 0)] if text else [])

    def finish(self) -> list[ToolEvent]:
        return [] if self._started else self.feed("")


class ToolCalls:
    """One choice's tool calls, fed the choice's text deltas (streaming) or its whole text."""

    def __init__(self, parser: _Parser, finish_as_tool_calls: bool, max_calls: int | None = None) -> None:
        self._parser = parser
        self._finish_as_tool_calls = finish_as_tool_calls  # "required" / "auto", not a named choice
        self._max_calls = max_calls  # parallel_tool_calls false with "auto": calls after the first dropped
        self._ids: list[str] = []
        self.content: list[str] = []
        self.calls: list[p.ToolCall] = []

    def delta(self, text: str, finished: bool) -> p.DeltaMessage:
        """The stream delta for `text` (and the flush at the end): content and tool-call pieces."""
        events = self._parser.feed(text) + (self._parser.finish() if finished else [])
        content = "".join(e.text for e in events if e.kind == "content")
        calls = [self._delta_call(e) for e in events
                 if e.kind != "content" and (self._max_calls is None or e.index < self._max_calls)]
        self.content.append(content)
        message = p.DeltaMessage()
        if content:
            message.content = content
        if calls:
            message.tool_calls = calls
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when calls were made (except for a named choice, which stays "stop")."""
        if reason == "stop" and self.calls and self._finish_as_tool_calls:
            return "tool_calls"
        return reason

    def message(self, text: str) -> p.ChatMessageOut:
        """The non-streaming message for the whole `text`."""
        self.delta(text, finished=True)
        content = "".join(self.content)
        return p.ChatMessageOut(content=content or None, tool_calls=self.calls)

    def _delta_call(self, event: ToolEvent) -> p.DeltaToolCall:
        if event.kind == "name":
            call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
            self._ids.append(call_id)
            self.calls.append(p.ToolCall(id=call_id, function=p.FunctionCall(name=event.text, arguments="")))
            return p.DeltaToolCall(index=event.index, id=call_id, type="function",
                                   function=p.DeltaFunctionCall(name=event.text, arguments=""))
        call = self.calls[event.index].function
        call.arguments += event.text
        return p.DeltaToolCall(index=event.index, function=p.DeltaFunctionCall(arguments=event.text))


def tool_calls_factory(request: p.ChatCompletionRequest, parser: str | None) -> Callable[[], ToolCalls] | None:
    """A maker of one `ToolCalls` per choice, or None when the request's output is plain content."""
    choice = tool_choice_of(request)
    if isinstance(choice, p.NamedToolChoice):
        name = choice.function.name
        return lambda: ToolCalls(_NamedParser(name), finish_as_tool_calls=False)
    if choice == "required":
        return lambda: ToolCalls(RequiredParser(), finish_as_tool_calls=True)
    if choice == "auto" and parser is not None:
        parser_cls = TOOL_CALL_PARSERS[parser]
        max_calls = None if request.parallel_tool_calls else 1
        return lambda: ToolCalls(parser_cls(), finish_as_tool_calls=True, max_calls=max_calls)
    return None
