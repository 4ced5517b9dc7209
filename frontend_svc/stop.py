"""Stop strings over a stream of text deltas.

`StopChecker.feed(delta)` returns the text that is safe to send now and the stop string that matched,
if one did. Invariants:
- Text is emitted only once no stop string can still match through it: the checker holds back the
  longest tail of the generated text that is a proper prefix of some stop string, so a partial stop
  string is never emitted.
- The match that *ends* first wins (ties: the longest); this makes the result independent of how the
  text was split into deltas. On a match, the text before it (plus the stop string itself when
  `include_stop_str_in_output`) is emitted and everything after it is dropped; the checker is then
  `stopped` and ignores further input.
- `flush()` releases the held-back tail when the request ends for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    __slots__ = ("_held", "_include", "_max_hold", "_prefixes", "_stops", "stopped")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        # Every proper prefix of every stop string: what the held-back tail may be.
        self._prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str, allow_stop: bool = True) -> tuple[str, str | None]:
        """Add generated text; return (text safe to emit now, the matched stop string or None).

        With `allow_stop=False` (e.g. before min_tokens is reached) no match is reported, but a tail
        that could still become a stop string is held back as usual.
        """
        if self.stopped:
            return "", None
        if not self._stops:
            return delta, None
        text = self._held + delta
        if allow_stop:
            match = self._earliest_match(text, len(self._held))
            if match is not None:
                return self._stop_at(text, *match)
        hold = self._hold_length(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """Release the held-back text (the request finished without a stop-string match)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _earliest_match(self, text: str, old: int) -> tuple[int, str] | None:
        """(start, stop string) of the match ending first after `text[:old]` (ties: longest), or None."""
        best: tuple[int, str] | None = None
        best_end = len(text) + 1
        for stop in self._stops:
            start = text.find(stop, max(0, old - len(stop) + 1))
            if start < 0:
                continue
            end = start + len(stop)
            if end < best_end or (end == best_end and best is not None and start < best[0]):
                best, best_end = (start, stop), end
        return best

    def _stop_at(self, text: str, start: int, stop: str) -> tuple[str, str]:
        self.stopped = True
        self._held = ""
        end = start + len(stop) if self._include else start
        return text[:end], stop

    def _hold_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for size in range(min(len(text), self._max_hold), 0, -1):
            if text[len(text) - size :] in self._prefixes:
                return size
        return 0
