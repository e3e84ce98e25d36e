"""Write-side coalescing in the runner: tokens produced while a frame was being written go out as one event."""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.sampling import SamplingParams
from services.worker.runner import Runner, _coalesce, run_sequence
from services.worker.stats import WorkerCounters
from services.worker.types import FinalEvent, GenerationRequest, TokenEvent
from tests.unit.worker.fakes import EOS, TOKENIZER, VOCAB, FakeEngine

PROMPT = tuple(TOKENIZER.encode("hi"))
_TOKENS = st.integers(min_value=1, max_value=len(VOCAB) - 1)  # any token but EOS


@given(st.lists(st.tuples(st.lists(_TOKENS, max_size=3), st.text(max_size=4)), min_size=1, max_size=12))
def test_coalesce_concatenates_waiting_token_events_in_order_and_leaves_the_end_marker(
    events: list[tuple[list[int], str]],
) -> None:
    queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
    for ids, text in events[1:]:
        queue.put_nowait(TokenEvent(tuple(ids), text))
    queue.put_nowait(None)
    merged = _coalesce(TokenEvent(tuple(events[0][0]), events[0][1]), queue)
    assert list(merged.token_ids) == [t for ids, _ in events for t in ids]
    assert merged.text == "".join(text for _, text in events)
    assert queue.get_nowait() is None and queue.empty()


def _unmerged(script: list[int], stop: tuple[str, ...], max_tokens: int) -> tuple[list[TokenEvent], FinalEvent]:
    """The events of a turn as the engine emits them, one per token (the reference)."""
    emitted: list[TokenEvent] = []
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=max_tokens, stop=stop))
    final = run_sequence(FakeEngine(script, loop=False), request, threading.Event(), emitted.append, WorkerCounters())
    return emitted, final


async def _through_runner(script: list[int], stop: tuple[str, ...], max_tokens: int) -> list[object]:
    """The same turn read through ``Turn.events()`` by a reader that falls behind after the first token.

    The engine is held after its first step until the reader has the first event, then runs to the
    end before the reader asks for more: everything after the first token is already waiting.
    """
    engine = FakeEngine(script, loop=False)
    engine.gate = threading.Semaphore(1)
    runner = Runner(engine, max_active=1, max_queue=0, keepalive_s=5.0)
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=max_tokens, stop=stop))
    try:
        async with aclosing(runner.turn(request).events()) as events:
            seen: list[object] = [await asyncio.wait_for(anext(events), 5)]
            if not isinstance(seen[0], FinalEvent):
                for _ in range(max_tokens):
                    engine.gate.release()
                if runner.running:  # (it may have finished already: one token, a stop string)
                    await asyncio.wait_for(asyncio.wait(list(runner.running)), 5)  # it has emitted all
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
    reference, final = _unmerged(script, stop, max_tokens)
    seen = asyncio.run(_through_runner(script, stop, max_tokens))
    tokens = [e for e in seen if isinstance(e, TokenEvent)]
    assert isinstance(seen[-1], FinalEvent) and seen[-1] == final
    assert [t for e in tokens for t in e.token_ids] == [t for e in reference for t in e.token_ids]
    assert "".join(e.text for e in tokens) == "".join(e.text for e in reference)
    # The first token went out alone, at once; all that waited behind it came as one frame.
    assert len(tokens) == min(len(reference), 2)
    if reference:
        assert tokens[0] == reference[0]
