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
- A match must end in text fed with `allow_stop=True`; text fed with `allow_stop=False` (before
  min_tokens) never matches, but its tail is held back like any other.
- `flush()` releases the held-back tail when the request ends for another reason.

Cost: the stop strings make one Aho-Corasick automaton (`StopAutomaton`) that every checker with the
same stop strings shares (the n completions of a request, and concurrent requests with the same list).
It is materialized lazily, state by state as text reaches it, with C-level string operations: creating
it sorts the strings and nothing more, so a fresh set of long stop strings costs no per-character
Python work up front (servers still create it on a worker thread, with the tokenizer's work). Feeding a
delta costs amortized O(len(delta)) plus copying the held tail, which is shorter than the longest stop
string; nothing is quadratic in a stop string's length, and an automaton never holds more states than
the characters fed to it.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Sequence


class StopAutomaton:
    """Aho-Corasick automaton over a set of stop strings (characters, not bytes), built lazily.

    A state stands for one distinct prefix u of some stop string: after reading a text, the longest
    suffix of it that is such a prefix. State 0 is the empty prefix. Per state: `match_len` (length of
    the longest stop string that is a suffix of u, 0 if none) and `hold_len` (length of the longest
    suffix of u that is a *proper* prefix of some stop string: the tail to hold back).

    States and transitions are materialized on first use, with C-level string operations (a bisection
    over the sorted stop strings, `startswith`/`endswith`), and memoized. So building the automaton does
    no per-character work at all, and a state is identified by (index of the first sorted stop string
    it prefixes, its length): a state holds O(1) memory, and there are never more states than characters
    fed plus one, nor more than the stop strings' distinct prefixes. A transition that misses costs
    O(|u|) string operations, amortized O(1) per character fed (each character lengthens u by at most
    one, each step of the search shortens it). Misses take a lock: checkers on several threads may share
    one automaton.
    """

    __slots__ = ("__weakref__", "_goto", "_ids", "_keys", "_lock", "_sorted", "hold_len", "match_len",
                 "stops")

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._sorted: list[str] = sorted(self.stops)
        self._keys: list[tuple[int, int]] = [(0, 0)]  # state -> (index into _sorted, length)
        self._ids: dict[tuple[int, int], int] = {(0, 0): 0}
        self._goto: list[dict[str, int]] = [{}]
        self.match_len: list[int] = [0]
        self.hold_len: list[int] = [0]
        self._lock = threading.Lock()

    @property
    def num_states(self) -> int:
        """States materialized so far."""
        return len(self._goto)

    def step(self, state: int, char: str) -> int:
        """The state after reading `char` in `state`."""
        nxt = self._goto[state].get(char)
        return nxt if nxt is not None else self._miss(state, char)

    def _miss(self, state: int, char: str) -> int:
        with self._lock:
            nxt = self._goto[state].get(char)
            if nxt is None:
                index, length = self._keys[state]
                text = self._sorted[index][:length] + char
                while text and self._first_with_prefix(text) is None:
                    text = text[1:]
                nxt = self._state_of(text)
                self._goto[state][char] = nxt
            return nxt

    def _first_with_prefix(self, text: str) -> int | None:
        """Index in `_sorted` of the first stop string that starts with `text`, or None."""
        i = bisect.bisect_left(self._sorted, text)
        return i if i < len(self._sorted) and self._sorted[i].startswith(text) else None

    def _is_proper_prefix(self, text: str) -> bool:
        # Strings that start with `text` are contiguous in sorted order, `text` itself first.
        i = bisect.bisect_right(self._sorted, text)
        return i < len(self._sorted) and self._sorted[i].startswith(text)

    def _state_of(self, text: str) -> int:
        """The state for `text`, a prefix of some stop string (materialized if new; lock held)."""
        index = self._first_with_prefix(text) or 0
        key = (index, len(text))
        state = self._ids.get(key)
        if state is None:
            state = len(self._goto)
            self._ids[key] = state
            self._keys.append(key)
            self._goto.append({})
            self.match_len.append(max((len(s) for s in self.stops if text.endswith(s)), default=0))
            hold = text
            while hold and not self._is_proper_prefix(hold):  # only when `text` is a whole stop string
                hold = hold[1:]
            self.hold_len.append(len(hold))
        return state


_compiled: weakref.WeakValueDictionary[tuple[str, ...], StopAutomaton] = weakref.WeakValueDictionary()
_compiled_lock = threading.Lock()


def compile_stops(stops: Sequence[str]) -> StopAutomaton:
    """The shared automaton for these stop strings (built once while any checker still uses it)."""
    key = tuple(dict.fromkeys(stops))
    with _compiled_lock:
        automaton = _compiled.get(key)
        if automaton is None:
            automaton = StopAutomaton(key)
            _compiled[key] = automaton
        return automaton


class StopChecker:
    __slots__ = ("_automaton", "_held", "_include", "_state", "stopped")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False,
                 automaton: StopAutomaton | None = None) -> None:
        """`automaton`: `compile_stops(stop)`, when the caller has it already."""
        self._automaton = automaton if automaton is not None else compile_stops(stop) if stop else None
        self._include = include_stop_str_in_output
        self._state = 0  # automaton state after everything fed so far
        self._held = ""
        self.stopped = False

    @property
    def automaton(self) -> StopAutomaton | None:
        return self._automaton

    def feed(self, delta: str, allow_stop: bool = True) -> tuple[str, str | None]:
        """Add generated text; return (text safe to emit now, the matched stop string or None).

        With `allow_stop=False` (e.g. before min_tokens is reached) no match is reported, but a tail
        that could still become a stop string is held back as usual.
        """
        if self.stopped:
            return "", None
        automaton = self._automaton
        if automaton is None:
            return delta, None
        text = self._held + delta
        offset = len(self._held)
        state = self._state
        step, match_len = automaton.step, automaton.match_len
        for i, char in enumerate(delta):
            state = step(state, char)
            if allow_stop and match_len[state]:
                end = offset + i + 1
                return self._stop_at(text, end - match_len[state], end)
        self._state = state
        hold = automaton.hold_len[state]
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """Release the held-back text (the request finished without a stop-string match)."""
        held, self._held = self._held, ""
        self._state = 0
        return "" if self.stopped else held

    def _stop_at(self, text: str, start: int, end: int) -> tuple[str, str]:
        self.stopped = True
        self._held = ""
        return text[: end if self._include else start], text[start:end]
