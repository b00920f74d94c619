"""StopStringMatcher on plain text: matches across deltas, truncation, holdback, earliest match."""

from __future__ import annotations

import random
from typing import Optional, Sequence

import pytest

from pyengine.errors import InvalidRequestError
from pyengine.text import StopStringMatcher, TextDelta


def run(matcher: StopStringMatcher, deltas: Sequence[str]) -> tuple[list[str], Optional[str]]:
    """Streamed pieces (the flush last) and the stop string reported."""
    streamed = [matcher.feed(delta).text for delta in deltas]
    streamed.append(matcher.flush())
    return streamed, matcher.stopped


def reference(text: str, stops: Sequence[str], include: bool) -> tuple[str, Optional[str]]:
    """Character by character: stop at the first position where some stop string ends
    (the longest one ending there, i.e. the one starting first)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def longest_stop_prefix_tail(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    tails = [
        k for s in stops for k in range(1, min(len(s), len(text) + 1)) if s.startswith(text[len(text) - k :])
    ]
    return max(tails, default=0)


def split(rng: random.Random, text: str) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        size = rng.randint(0, 4)
        pieces.append(text[i : i + size])
        i += size
    return pieces


def test_a_stop_string_spanning_deltas_truncates_and_is_reported() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("Hello S") == TextDelta("Hello ")  # "S" could start "STOP": held
    assert matcher.feed("TO") == TextDelta("")
    assert matcher.feed("P and more") == TextDelta("", "STOP")
    assert matcher.stopped == "STOP"
    assert matcher.feed("ignored") == TextDelta("", "STOP")
    assert matcher.flush() == ""


def test_include_stop_str_in_output_keeps_it_and_holds_nothing_back() -> None:
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert matcher.feed("Hello S") == TextDelta("Hello S")
    assert matcher.feed("TOP and more") == TextDelta("TOP", "STOP")


def test_held_back_text_is_released_when_it_stops_looking_like_a_stop_string() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("x </ans").text == "x "
    assert matcher.feed("wer is").text == "</answer is"
    assert matcher.feed(" <").text == " "
    assert matcher.flush() == "<"
    assert matcher.stopped is None


def test_earliest_match_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w", "xyz"])
    assert matcher.feed("hello world xyz") == TextDelta("hel", "lo w")
    # The one that completes first wins even when listed later.
    assert StopStringMatcher(["cd", "b"]).feed("abcd") == TextDelta("a", "b")
    # Both end at the same character: the longer (earlier-starting) one cuts more.
    assert StopStringMatcher(["c", "bc"]).feed("abc") == TextDelta("a", "bc")


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == TextDelta("anything")
    assert matcher.flush() == ""


def test_a_single_string_is_one_stop_string() -> None:
    assert StopStringMatcher("ab").feed("xaby") == TextDelta("x", "ab")


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(InvalidRequestError):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("include", [False, True])
def test_random_texts_and_splits_match_a_character_by_character_reference(include: bool) -> None:
    """Holdback never leaks: the deltas only ever grow the final (cut) text, whatever the split;
    and it is minimal: exactly the longest tail that could still grow into a stop string waits."""
    rng = random.Random(11)
    for _ in range(1500):
        stops = [
            "".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 30)))
        expected_text, expected_stop = reference(text, stops, include)
        matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
        fed, streamed = "", ""
        for delta in split(rng, text):
            fed += delta
            streamed += matcher.feed(delta).text
            assert expected_text.startswith(streamed)  # nothing streamed that the end would cut
            if matcher.stopped is None:
                assert len(fed) - len(streamed) == (0 if include else longest_stop_prefix_tail(fed, stops))
        streamed += matcher.flush()
        assert (streamed, matcher.stopped) == (expected_text, expected_stop), (stops, text)
