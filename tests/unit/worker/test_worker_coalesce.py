"""Coalescing in the runtime: tokens produced while the reader was busy come out as one event per
choice, with the same tokens and text as one event per token would carry."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import aclosing

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.generation import GenerationEvent, GenerationRequest
from services.common.sampling import SamplingParams
from services.worker.runner import Runner
from tests.unit.worker.fakes import EOS, TOKENIZER, VOCAB, FakeEngine, reference_events

PROMPT = tuple(TOKENIZER.encode("hi"))
_TOKENS = st.integers(min_value=1, max_value=len(VOCAB) - 1)  # any token but EOS


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the turn never ended")


async def _through_runner(script: list[int], stop: tuple[str, ...], max_tokens: int) -> list[GenerationEvent]:
    """The turn read through ``Turn.events()`` by a reader that falls behind after the first token.

    The engine is held after its first step until the reader has the first event, then runs to the
    end before the reader asks for more: everything after the first token is already waiting.
    """
    engine = FakeEngine(script, loop=False)
    engine.gate = threading.Semaphore(1)
    runner = Runner(engine, max_active=1, max_queue=0, keepalive_s=5.0)
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=max_tokens, stop=stop))
    try:
        async with aclosing(runner.turn(request).events()) as events:
            seen = [await asyncio.wait_for(anext(events), 5)]
            if seen[0].final is None:
                for _ in range(max_tokens):
                    engine.gate.release()
                await _until(lambda: not runner.running)  # it has ended: every token is waiting
            seen += [e async for e in events]
    finally:
        await runner.aclose()
    return seen


@settings(max_examples=25, deadline=None)
@given(
    script=st.lists(st.one_of(_TOKENS, st.just(EOS)), min_size=1, max_size=12),
    stop=st.sampled_from([(), ("o",), ("lo w",), ("\u00e9",)]),
    max_tokens=st.integers(min_value=1, max_value=10),
)
def test_a_reader_that_falls_behind_gets_the_same_tokens_and_text_in_fewer_frames(
    script: list[int], stop: tuple[str, ...], max_tokens: int
) -> None:
    reference, final = reference_events(script, PROMPT, SamplingParams(max_tokens=max_tokens, stop=stop), loop=False)
    seen = asyncio.run(_through_runner(script, stop, max_tokens))
    tokens = [e for e in seen if e.final is None]
    assert seen[-1] == final
    assert [t for e in tokens for t in e.token_ids] == [t for e in reference for t in e.token_ids]
    assert "".join(e.text for e in tokens) == "".join(e.text for e in reference)
    # The first token went out alone, at once; all that waited behind it came as one frame.
    assert len(tokens) == min(len(reference), 2)
    if reference:
        assert tokens[0] == reference[0]
