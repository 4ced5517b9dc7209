"""StopChecker: hold-back of partial stop strings, matches across deltas, include/exclude, flush."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from shared_runtime.stop import StopChecker


def run(deltas, stops, include=False):
    """Feed deltas until a match; return (emitted text, matched stop or None)."""
    checker = StopChecker(stops, include)
    emitted = []
    for delta in deltas:
        text, matched = checker.feed(delta)
        emitted.append(text)
        if matched is not None:
            return "".join(emitted), matched
    emitted.append(checker.flush())
    return "".join(emitted), None


def reference(text, stops, include):
    """Brute force: the stop string whose match ends first (longest on a tie) cuts the text."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def test_stop_string_spanning_several_deltas_is_never_emitted_in_part():
    checker = StopChecker(["STOP"], False)
    assert checker.feed("hello S") == ("hello ", None)
    assert checker.feed("T") == ("", None)
    assert checker.feed("O") == ("", None)
    assert checker.feed("P and more") == ("", "STOP")
    assert checker.stopped and checker.feed("x") == ("", None)


def test_include_stop_str_in_output_emits_the_stop_string_and_drops_the_rest():
    assert run(["ab", "c<e", "nd>tail"], ["<end>"], include=True) == ("abc<end>", "<end>")
    assert run(["ab", "c<e", "nd>tail"], ["<end>"], include=False) == ("abc", "<end>")


def test_held_prefix_is_released_when_it_stops_matching():
    checker = StopChecker(["abc"], False)
    assert checker.feed("xa") == ("x", None)
    assert checker.feed("b") == ("", None)
    assert checker.feed("d") == ("abd", None)


def test_several_stop_strings_the_first_to_appear_wins():
    assert run(["one two three"], ["three", "two"]) == ("one ", "two")
    assert run(["xx", "y", "z"], ["yz", "xxy"]) == ("", "xxy")  # "xxy" ends before "yz"


def test_match_in_the_very_first_delta():
    assert run(["STOP right away"], ["STOP"]) == ("", "STOP")
    assert run(["STOP right away"], ["STOP"], include=True) == ("STOP", "STOP")


def test_flush_releases_the_held_tail_when_finishing_otherwise():
    checker = StopChecker(["</s>"], False)
    assert checker.feed("done </") == ("done ", None)
    assert checker.flush() == "</"
    assert checker.flush() == ""


def test_no_stop_strings_passes_text_through():
    checker = StopChecker([], False)
    assert checker.feed("anything") == ("anything", None)
    assert checker.flush() == ""


def test_allow_stop_false_holds_back_but_does_not_match():
    checker = StopChecker(["ab"], False)
    assert checker.feed("xab", allow_stop=False) == ("xab", None)  # min_tokens not reached yet
    assert checker.feed("a", allow_stop=False) == ("", None)  # still held: may become "ab"
    assert checker.feed("b") == ("", "ab")


def test_multibyte_stop_strings():
    assert run(["日本", "語です"], ["語で"]) == ("日本", "語で")


ALPHABET = "abé!"


@st.composite
def chunked_text(draw):
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    chunked=chunked_text(),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_any_chunking_gives_the_reference_output_and_never_a_partial_stop(chunked, stops, include):
    text, deltas = chunked
    checker = StopChecker(stops, include)
    fed, emitted, matched = "", "", None
    for delta in deltas:
        fed += delta
        out, matched = checker.feed(delta)
        emitted += out
        if matched is not None:
            break
        for stop in stops:  # no tail of the text so far that could still grow into a stop is out
            for i in range(1, len(stop)):
                if fed.endswith(stop[:i]):
                    assert len(emitted) <= len(fed) - i
    if matched is None:
        emitted += checker.flush()
    assert (emitted, matched) == reference(text, stops, include)


def reference_gated(deltas, allow, stops, include):
    """Brute force with min_tokens gating: a match counts only if it ends in a delta fed with allow=True."""
    text = "".join(deltas)
    allowed_ends = set()
    pos = 0
    for delta, ok in zip(deltas, allow):
        if ok:
            allowed_ends.update(range(pos + 1, pos + len(delta) + 1))
        pos += len(delta)
    for end in range(1, len(text) + 1):
        if end not in allowed_ends:
            continue
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def longest_held_tail(text, stops):
    """Brute force: the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for i in range(1, len(stop)):
            if i <= len(text) and text.endswith(stop[:i]):
                best = max(best, i)
    return best


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(
    chunked=chunked_text(),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=7), min_size=1, max_size=5),
    include=st.booleans(),
    gates=st.lists(st.booleans(), min_size=13, max_size=13),
)
def test_automaton_checker_equals_brute_force_with_min_tokens_gating(chunked, stops, include, gates):
    """The Aho-Corasick checker against a brute-force reference: same output, same stop, and after
    every delta exactly the longest proper-prefix tail is held back (never more, never less)."""
    _, deltas = chunked
    allow = gates[: len(deltas)]
    checker = StopChecker(stops, include)
    fed, emitted, matched = "", "", None
    for delta, ok in zip(deltas, allow):
        fed += delta
        out, matched = checker.feed(delta, allow_stop=ok)
        emitted += out
        if matched is not None:
            break
        assert len(fed) - len(emitted) == longest_held_tail(fed, stops)
    if matched is None:
        emitted += checker.flush()
    assert (emitted, matched) == reference_gated(deltas, allow, stops, include)


def test_overlapping_stop_strings_earliest_end_then_longest():
    # "abcd" ends at 4, "bc" ends at 3: "bc" wins although "abcd" starts first.
    assert run(["abcd"], ["abcd", "bc"]) == ("a", "bc")
    # Same end: the longest wins.
    assert run(["xabc"], ["bc", "abc"]) == ("x", "abc")
    # A stop string that is a suffix of a longer one ("c" in "abc") is found through failure links.
    assert run(["ab", "c"], ["abd", "c"]) == ("ab", "c")


def test_automaton_is_built_lazily_and_never_outgrows_the_text_fed():
    long_stop = "ab" * 8192  # a 16 KiB stop string
    checker = StopChecker([long_stop])
    assert checker.automaton.num_states == 1  # creating it did no per-character work
    checker.feed("x" * 100)
    assert checker.automaton.num_states == 1
    checker.feed("ab" * 100)
    assert checker.automaton.num_states == 201  # one state per prefix reached, no more
    stops = [f"{i:02d}" + "x" * 1000 for i in range(16)]
    checker = StopChecker(stops)
    fed = "".join(stops)[:5000] + "yyyy"
    checker.feed(fed, allow_stop=False)
    assert checker.automaton.num_states <= min(len(fed), sum(map(len, stops))) + 1


def test_completions_with_the_same_stop_strings_share_one_automaton():
    stops = ["<|end|>", "\n\nUser:"]
    checkers = [StopChecker(list(stops), False) for _ in range(16)]
    assert all(c.automaton is checkers[0].automaton for c in checkers)
    assert StopChecker(["other"]).automaton is not checkers[0].automaton


def test_a_16k_stop_string_with_16_completions_stays_small_and_correct():
    """What raised frontend memory by ~2 GB before (a set of every prefix per completion): now one shared
    automaton of 16 Ki states; feeding text that keeps nearly matching holds back only the live tail."""
    import tracemalloc

    long_stop = "ab" * 8192
    tracemalloc.start()
    try:
        checkers = [StopChecker([long_stop], False) for _ in range(16)]
        for checker in checkers:
            out, matched = checker.feed("ab" * 100 + "x" + "ab" * 50)
            assert matched is None and out == "ab" * 100 + "x"  # "ab"*50 is held: it may still match
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 1024 * 1024, f"peak {peak / 2**20:.0f} MiB"
    assert checkers[0].feed(long_stop[100:]) == ("", long_stop)
