"""A Messages answer, from the chat path's deltas: the whole body, or Anthropic's stream events (vLLM 0.32's).

Content: the text (one `text` block, when there is any) then one `tool_use` block per tool call the chat
path's tool parser found (frontend_svc/openai/tools.py: the server's --tool-call-parser for tool_choice
auto, the engine-constrained call for any / tool); a body with neither has one empty text block, as vLLM.

`stop_reason` (vLLM's mapping): "max_tokens" on a length cut; else "tool_use" when a call was made and
its arguments are complete JSON; else "stop_sequence" (with `stop_sequence` the matched string) when a
stop sequence ended it; else "tool_use" when a call was started; else "end_turn". A call whose arguments
were cut short has `input` {} in the body (the stream sent what there was as `input_json_delta`s).

Stream: `message_start` (the message with empty content and usage input_tokens), then per block
`content_block_start`, `content_block_delta`s (`text_delta` / `input_json_delta`), `content_block_stop`,
then `message_delta` (stop_reason, stop_sequence, usage) and `message_stop`, each as
`event: <type>` + `data: <json>`. Text that follows a tool call is held back and sent as a text block
after that call's block closes (vLLM's order). An engine failure after the status line is an `error`
event (Anthropic's shape) and the stream ends.

Usage: input_tokens are the prompt's tokens, output_tokens the generated ones (vLLM without
--enable-prompt-tokens-details: no cache fields).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from frontend_svc.anthropic.errors import error_body
from frontend_svc.openai.errors import ApiError
from frontend_svc.openai.tools import ToolCalls
from frontend_svc.outputs import CompletionDelta


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class MessageBuilder:
    """One message's answer: fed the (single) completion's deltas, as a body or as stream events."""

    def __init__(self, message_id: str, model: str, tool_calls: Callable[[], ToolCalls] | None) -> None:
        self.id = message_id
        self.model = model
        self.calls = tool_calls() if tool_calls is not None else None
        self.input_tokens = self.output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text = ""
        self.tool_args: list[str] = []  # each call's arguments so far, in call order
        # streaming state: the open block (its kind and index, the call it is) and held-back text
        self.next_index = 0
        self.open_kind: str | None = None
        self.open_call = -1
        self.pending = ""

    def prompt_tokens(self, count: int) -> None:
        self.input_tokens = count

    def _finish(self, delta: CompletionDelta) -> None:
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.usage is not None:
            self.input_tokens = delta.usage.prompt_tokens
            self.output_tokens = delta.usage.completion_tokens

    def _stop(self) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence), vLLM's `_to_anthropic_stop_reason`."""
        used = bool(self.tool_args)
        complete = used and _is_json(self.tool_args[-1])
        if self.finish_reason == "length":
            return "max_tokens", None
        if self.finish_reason != "stop":
            return None, None
        if complete:
            return "tool_use", None
        if isinstance(self.stop_reason, str):
            return "stop_sequence", self.stop_reason
        return ("tool_use" if used else "end_turn"), None

    def _usage(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}

    # -- whole body
    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self._finish(delta)

    def body(self) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        text, calls = self.text, []
        if self.calls is not None:
            message = self.calls.message(self.text)
            text, calls = message.content or "", message.tool_calls
            self.tool_args = [call.function.arguments for call in calls]
        if text:
            content.append({"type": "text", "text": text})
        for call in calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                            "input": _input(call.function.arguments)})
        stop_reason, stop_sequence = self._stop()
        out: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant",
                               "content": content or [{"type": "text", "text": ""}], "model": self.model,
                               "stop_reason": stop_reason}
        if stop_sequence is not None:
            out["stop_sequence"] = stop_sequence
        out["usage"] = self._usage()
        return out

    # -- stream
    def opening(self) -> str:
        return event("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": self.input_tokens,
                                                                  "output_tokens": 0}}})

    def events(self, delta: CompletionDelta) -> str:
        """The events of one delta (its text through the tool parser, if any)."""
        self._finish(delta)
        if self.calls is None:
            return self._text(delta.text)
        message = self.calls.delta(delta.text, delta.finished)
        out = self._text(message.content or "")
        for call in message.tool_calls or []:
            if call.id is not None:  # a call starts
                out += self._close() + self._start({"type": "tool_use", "id": call.id,
                                                    "name": call.function.name if call.function else "",
                                                    "input": {}}, "tool_use")
                self.open_call = call.index
                self.tool_args.append("")
            args = call.function.arguments if call.function is not None else None
            if args and call.index == self.open_call:
                self.tool_args[-1] += args
                out += self._delta({"type": "input_json_delta", "partial_json": args})
        return out

    def closing(self) -> str:
        stop_reason, stop_sequence = self._stop()
        return (self._close()
                + event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                          "usage": self._usage()})
                + event("message_stop", {"type": "message_stop"}))

    def error(self, error: ApiError) -> str:
        return event("error", error_body(error))

    def _text(self, text: str) -> str:
        if not text:
            return ""
        if self.open_kind == "tool_use":
            self.pending += text
            return ""
        out = "" if self.open_kind == "text" else self._close() + self._start({"type": "text", "text": ""}, "text")
        return out + self._delta({"type": "text_delta", "text": text})

    def _start(self, block: dict[str, Any], kind: str) -> str:
        self.open_kind = kind
        return event("content_block_start", {"type": "content_block_start", "content_block": block,
                                             "index": self.next_index})

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": self.next_index})

    def _close(self) -> str:
        """Close the open block, then send held-back text as a block of its own."""
        out = ""
        if self.open_kind is not None:
            out = event("content_block_stop", {"type": "content_block_stop", "index": self.next_index})
            self.open_kind, self.open_call = None, -1
            self.next_index += 1
        if self.pending:
            text, self.pending = self.pending, ""
            out += self._start({"type": "text", "text": ""}, "text") + self._delta({"type": "text_delta", "text": text})
            out += self._close()
        return out


def _input(arguments: str) -> dict[str, Any]:
    """A call's `input`: its arguments when they are a complete JSON object, else {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
