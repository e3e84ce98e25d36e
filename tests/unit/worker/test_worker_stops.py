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


def test_pass_through_releases_held_text_and_matches_nothing() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("a E") == ("a ", False)  # "E" may begin the stop string: held
    assert matcher.pass_through("ND b") == "END b"  # min_tokens not reached: no matching
    assert matcher.feed(" c END") == (" c ", True)


async def test_min_tokens_ignores_stop_strings_until_reached_in_the_runner() -> None:
    from services.common.generation import FinishReason, GenerationRequest
    from services.common.sampling import SamplingParams
    from services.worker.runner import Runner
    from tests.unit.worker.fakes import FakeEngine

    async def run(min_tokens: int, resume: tuple[int, ...] = ()) -> tuple[str, FinishReason, int]:
        runner = Runner(FakeEngine("hello world"), max_active=1, max_queue=0)
        sampling = SamplingParams(max_tokens=20, stop=("o",), min_tokens=min_tokens)
        try:
            events = [e async for e in runner.turn(GenerationRequest((1,), sampling, resume)).events()]
        finally:
            await runner.aclose()
        final = events[-1].final
        assert final is not None
        return "".join(e.text for e in events), final.reason, final.completion_tokens

    # tokens: "hello", " world", "hello", ...: "o" is in the first token
    assert await run(0) == ("hell", FinishReason.STOP_STRING, 1)
    text, reason, tokens = await run(2)
    assert (text, reason, tokens) == ("hello worldhell", FinishReason.STOP_STRING, 3)
    # a resumed stream's tokens count toward min_tokens (vLLM's rule: the first min_tokens are never cut)
    assert (await run(2, resume=(1,)))[1:] == (FinishReason.STOP_STRING, 2)
