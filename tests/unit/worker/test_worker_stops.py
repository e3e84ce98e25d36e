from __future__ import annotations

from services.worker.stops import StopStringMatcher


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    out = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", False)


def test_stop_inside_one_delta_cuts_before_it() -> None:
    assert feed_all(StopStringMatcher(["END"]), ["hello END world"]) == ("hello ", True)


def test_stop_split_across_deltas_is_found_and_prefix_held_back() -> None:
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.feed("answer\n") == ("answer", False)
    assert matcher.feed("\nUs") == ("", False)
    assert matcher.feed("er: more") == ("", True)


def test_false_prefix_is_released_once_it_cannot_match() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("AR") == ("STAR", False)


def test_held_text_is_flushed_at_the_end() -> None:
    assert feed_all(StopStringMatcher(["STOP"]), ["go ST"]) == ("go ST", False)


def test_earliest_of_several_stops_wins() -> None:
    assert feed_all(StopStringMatcher(["b", "a"]), ["xxab"]) == ("xx", True)


def test_nothing_after_stop() -> None:
    matcher = StopStringMatcher(["x"])
    matcher.feed("x")
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""
