"""Tool calls out of generated text, incrementally: the same machine serves streaming and non-streaming
responses, so a stream's pieces always reassemble to the non-streaming calls.

A parser is fed text (a stream's deltas, or the whole text at once) and returns `ToolEvent`s: content
text, a call's name (the call starts), or a piece of a call's arguments. Arguments are copied in one
canonical form as they arrive: no whitespace outside strings, `", "` and `": "` between items (what
`json.dumps` writes, and what vLLM's parsers return), strings and numbers verbatim.

Formats:
- `hermes` (Hermes 2 Pro, Qwen 2.5/3, ...; vLLM's `--tool-call-parser hermes`): free text, then calls as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Content is the text before the first call
  (as vLLM returns it); text between and after calls is dropped. A call whose JSON is malformed is
  skipped up to its `</tool_call>` (vLLM would return the whole text as content instead; a stream cannot
  take back what it sent, and both modes must agree).
- `required` (tool_choice "required"): the engine-enforced JSON array `[{"name": ..., "parameters":
  {...}}, ...]` (the schema vLLM builds from the tools).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"


@dataclass(frozen=True, slots=True)
class ToolEvent:
    kind: str  # "content", "name" (a call starts), "args" (append to the call's arguments)
    text: str
    index: int = -1  # the call's index among this completion's calls


class _ValueCopier:
    """One JSON value, char by char, in canonical form. `feed` returns (text to emit, consumed); a value
    that is a bare number or literal ends at the first char that cannot continue it (not consumed)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.scalar = False
        self.started = False
        self.done = False

    def feed(self, ch: str) -> tuple[str, bool]:
        if not self.started:
            if ch in _WS:
                return "", True
            self.started = True
            if ch not in "{[\"":
                self.scalar = True
        if self.scalar:
            if ch in _WS or ch in ",}]":
                self.done = True
                return "", False
            return ch, True
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                self.done = self.depth == 0
            return ch, True
        if ch in _WS:
            return "", True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        elif ch == ",":
            return ", ", True
        elif ch == ":":
            return ": ", True
        return ch, True


class _CallObject:
    """`{"name": "...", "<args_key>": VALUE, ...}` parsed char by char (keys in any order; other keys
    skipped). Emits the name once complete, then argument pieces; arguments seen before the name are
    held until it is known."""

    def __init__(self, args_key: str) -> None:
        self.args_key = args_key
        self.state = "start"  # start, key, in_key, colon, value, name, args, skip, after, done, error
        self.key: list[str] = []
        self.raw_name: list[str] = []
        self.name_escape = False
        self.name: str | None = None
        self.pending_args: list[str] = []
        self.copier = _ValueCopier()

    @property
    def finished(self) -> bool:
        return self.state in ("done", "error")

    def feed(self, ch: str, out: list[tuple[str, str]]) -> bool:
        """Consume `ch` (True) or leave it for the caller (False, once finished); appends ("name"|"args",
        text) to `out`."""
        state = self.state
        if state in ("done", "error"):
            return False
        if state in ("args", "skip"):
            text, consumed = self.copier.feed(ch)
            if text and state == "args":
                self._args(text, out)
            if self.copier.done:
                self.state = "after"
            return consumed or self.feed(ch, out)
        if state == "in_key":
            if ch == '"' and not (self.key and self.key[-1] == "\\"):
                self.state = "colon"
            else:
                self.key.append(ch)
            return True
        if state == "name":
            if self.name_escape:
                self.name_escape = False
            elif ch == "\\":
                self.name_escape = True
            elif ch == '"':
                self._named(out)
                self.state = "after"
                return True
            self.raw_name.append(ch)
            return True
        if ch in _WS:
            return True
        expected = {"start": "{", "key": '"}', "colon": ":", "after": ",}"}.get(state)
        if state == "value":
            return self._value(ch, out)
        if expected is None or ch not in expected:
            self.state = "error"
            return True
        if state == "start":
            self.state = "key"
        elif state == "key":
            self.state = "done" if ch == "}" else "in_key"
            self.key = []
        elif state == "colon":
            self.state = "value"
        else:  # after
            self.state = "key" if ch == "," else "done"
        return True

    def _value(self, ch: str, out: list[tuple[str, str]]) -> bool:
        key = "".join(self.key)
        self.copier = _ValueCopier()
        if key == "name" and ch == '"' and self.name is None:
            self.state = "name"
            return True
        self.state = "args" if key == self.args_key else "skip"
        return self.feed(ch, out)

    def _args(self, text: str, out: list[tuple[str, str]]) -> None:
        if self.name is None:
            self.pending_args.append(text)
        else:
            out.append(("args", text))

    def _named(self, out: list[tuple[str, str]]) -> None:
        raw = "".join(self.raw_name)
        try:
            self.name = str(json.loads(f'"{raw}"'))
        except ValueError:
            self.name = raw
        out.append(("name", self.name))
        if self.pending_args:
            out.append(("args", "".join(self.pending_args)))
            self.pending_args = []


class _CallSequence:
    """Numbers the calls of one completion and turns object events into `ToolEvent`s."""

    def __init__(self) -> None:
        self.num_calls = 0

    def emit(self, obj: _CallObject, ch: str, events: list[ToolEvent]) -> bool:
        pieces: list[tuple[str, str]] = []
        consumed = obj.feed(ch, pieces)
        for kind, text in pieces:
            if kind == "name":
                self.num_calls += 1
            events.append(ToolEvent(kind, text, self.num_calls - 1))
        return consumed


class _CharParser:
    """Feeds text char by char to `_feed_char`; returns the events merged (one per call per feed)."""

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        for ch in text:
            self._feed_char(ch, events)
        return _merged(events)

    def finish(self) -> list[ToolEvent]:
        return []

    def _feed_char(self, ch: str, events: list[ToolEvent]) -> None:
        raise NotImplementedError


class HermesParser(_CharParser):
    """`<tool_call>{json}</tool_call>` calls after optional content (see the module docstring)."""

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self) -> None:
        self._state = "content"  # content, call, after_call, skip
        self._held = ""  # content (or tag) text not yet decided
        self._seen_call = False
        self._obj = _CallObject("arguments")
        self._calls = _CallSequence()

    def finish(self) -> list[ToolEvent]:
        """What is still held back (content that turned out not to start a call)."""
        held, self._held = self._held, ""
        if self._state == "content" and held and not self._seen_call:
            return [ToolEvent("content", held)]
        return []

    def _feed_char(self, ch: str, events: list[ToolEvent]) -> None:
        if self._state == "call":
            consumed = self._calls.emit(self._obj, ch, events)
            if self._obj.finished:
                self._state = "skip"
            if consumed:
                return
        if self._state == "skip":  # until </tool_call>
            self._held = _tail(self._held + ch, self.END)
            if self._held == self.END:
                self._state, self._held = "after_call", ""
            return
        # content or after_call: look for <tool_call>
        held = self._held + ch
        if held.endswith(self.START):
            before = held[: -len(self.START)]
            if before and self._state == "content" and not self._seen_call:
                events.append(ToolEvent("content", before))
            self._state, self._held, self._seen_call = "call", "", True
            self._obj = _CallObject("arguments")
            return
        keep = _prefix_len(held, self.START)
        emit, self._held = held[: len(held) - keep], held[len(held) - keep:]
        if emit and self._state == "content" and not self._seen_call:
            events.append(ToolEvent("content", emit))


class RequiredParser(_CharParser):
    """The JSON array of tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`."""

    def __init__(self) -> None:
        self._state = "start"  # start, item, call, after, done
        self._obj = _CallObject("parameters")
        self._calls = _CallSequence()

    def _feed_char(self, ch: str, events: list[ToolEvent]) -> None:
        if self._state == "call":
            consumed = self._calls.emit(self._obj, ch, events)
            if self._obj.finished:
                self._state = "after"
            if consumed:
                return
        if ch in _WS or self._state == "done":
            return
        if self._state == "start" and ch == "[":
            self._state = "item"
        elif self._state == "item" and ch == "{":
            self._obj = _CallObject("parameters")
            self._state = "call"
            self._calls.emit(self._obj, ch, events)
        elif self._state == "after":
            self._state = "item" if ch == "," else "done"


def _merged(events: list[ToolEvent]) -> list[ToolEvent]:
    """Adjacent pieces of the same kind and call joined (one delta per call per feed)."""
    merged: list[ToolEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if last is not None and event.kind != "name" and last.kind == event.kind and last.index == event.index:
            merged[-1] = ToolEvent(last.kind, last.text + event.text, last.index)
        else:
            merged.append(event)
    return merged


def _prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _tail(text: str, tag: str) -> str:
    """The suffix of `text` that may still become `tag` (or `tag` itself once complete)."""
    if text.endswith(tag):
        return tag
    n = _prefix_len(text, tag)
    return text[len(text) - n:] if n else ""


TOOL_CALL_PARSERS = {"hermes": HermesParser}
TOOL_CALL_PARSER_NAMES = tuple(TOOL_CALL_PARSERS)
