"""StopChecker: hold-back of partial stop strings, matches across deltas, include/exclude, flush."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_svc.stop import StopChecker


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
