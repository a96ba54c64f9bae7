"""Stop strings over streamed text (core.output.stopping): held back where one may begin,
and none ending where matching is off (vLLM's min_tokens)."""

from __future__ import annotations

from pdchat.core.output.stopping import StopStringMatcher


def test_text_is_held_back_where_a_stop_string_may_begin_and_cut_at_one():
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("hello ST") == ("hello", False)  # " ST" may begin STOP
    assert matcher.feed("OP and more") == (" ", True)


def test_no_stop_string_ends_in_text_fed_without_matching():
    matcher = StopStringMatcher(("STOP",))
    released, stopped = matcher.feed("aSTOPb", match=False)
    assert not stopped
    released_after, stopped = matcher.feed("c")
    assert (released + released_after + matcher.flush(), stopped) == ("aSTOPbc", False)


def test_a_stop_string_begun_before_matching_and_ended_after_still_stops():
    matcher = StopStringMatcher(("XY",))
    assert matcher.feed("aX", match=False) == ("a", False)
    assert matcher.feed("Yb") == ("", True)
