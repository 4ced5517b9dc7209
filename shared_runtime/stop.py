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

Cost: the stop strings are compiled once into an Aho-Corasick automaton (`StopAutomaton`, one state per
distinct prefix, so memory is linear in their total length) that every checker with the same stop
strings shares (the n completions of a request, and concurrent requests with the same list). Building
it is pure Python, linear in the strings' total length but not free (16 strings of 1,024 characters are
16k states): servers build it off their event loop (`compile_stops` on a worker thread) and hand it to
the checkers, which then cost nothing to create. Feeding
a delta costs amortized O(len(delta)) plus copying the held tail, which is shorter than the longest
stop string; nothing is quadratic in a stop string's length.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence


class StopAutomaton:
    """Aho-Corasick automaton over a set of stop strings (characters, not bytes).

    State 0 is the root (the empty prefix); state s stands for one distinct prefix of some stop string.
    Per state: `goto` (trie edges), `fail` (the state of the longest proper suffix that is also a
    prefix), `match_len` (length of the longest stop string ending here, 0 if none) and `hold_len`
    (length of the longest suffix that is a *proper* prefix of some stop string: the tail to hold back).
    """

    __slots__ = ("__weakref__", "_fail", "_goto", "hold_len", "match_len", "stops")

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._goto: list[dict[str, int]] = [{}]
        depth = [0]
        ends = [0]  # length of the stop string that ends exactly at this state (0 if none)
        for stop in self.stops:
            state = 0
            for char in stop:
                nxt = self._goto[state].get(char)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[state][char] = nxt
                    self._goto.append({})
                    depth.append(depth[state] + 1)
                    ends.append(0)
                state = nxt
            ends[state] = len(stop)
        self._fail = [0] * len(self._goto)
        self.match_len = list(ends)
        self.hold_len = [0] * len(self._goto)
        self._link(depth)

    def _link(self, depth: list[int]) -> None:
        """Failure links, breadth first; then match and hold lengths, which follow them."""
        goto, fail = self._goto, self._fail
        order: list[int] = []
        frontier = list(goto[0].values())
        while frontier:
            order.extend(frontier)
            nxt: list[int] = []
            for state in frontier:
                for char, child in goto[state].items():
                    f = fail[state]
                    while f and char not in goto[f]:
                        f = fail[f]
                    candidate = goto[f].get(char, 0)
                    fail[child] = candidate if candidate != child else 0
                    nxt.append(child)
            frontier = nxt
        for state in order:  # parents' (shorter) failure targets are final before their children's
            if not self.match_len[state]:
                self.match_len[state] = self.match_len[fail[state]]
            # A state with trie edges is a proper prefix of some stop string: hold all of it.
            self.hold_len[state] = depth[state] if goto[state] else self.hold_len[fail[state]]

    @property
    def num_states(self) -> int:
        return len(self._goto)

    def step(self, state: int, char: str) -> int:
        """The state after reading `char` in `state`."""
        goto, fail = self._goto, self._fail
        while state and char not in goto[state]:
            state = fail[state]
        return goto[state].get(char, 0)


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
        """`automaton`: `compile_stops(stop)`, when the caller built it already (off an event loop: a
        fresh set of 16 stop strings of 1,024 characters takes tens of milliseconds of pure Python)."""
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
