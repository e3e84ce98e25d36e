"""A cancel ends a turn at once and stops its sequence in the engine before the next step: a prefill
of many chunks stops after the chunk in flight, a decode after the step in flight, and the KV is
freed (never kept for the chat's next turn)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import aclosing

from services.common.generation import FinishReason, GenerationRequest
from services.common.sampling import SamplingParams
from services.worker.runner import Runner
from tests.unit.worker.fakes import TOKENIZER, FakeEngine

PROMPT = tuple(TOKENIZER.encode("hi"))


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_cancel_during_a_long_prefill_stops_it_after_the_chunk_in_flight() -> None:
    engine = FakeEngine(prefill_steps=10_000, step_s=0.005, chat=True)  # a prefill of 10,000 chunks
    runner = Runner(engine, max_active=1, max_queue=0, keepalive_s=0.02)
    session = runner.sessions.open()
    turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=4)), session)
    try:
        async with aclosing(turn.events()) as events:
            assert (await asyncio.wait_for(anext(events), 5)).queued  # prefilling
            await _until(lambda: engine.calls > 0, "the prefill runs")
            turn.cancel()
            at_cancel = engine.calls
            rest = [e async for e in events]
            await _until(lambda: not engine.live, "the engine stopped the sequence")
            assert engine.calls - at_cancel <= 2  # the chunk in flight, at most one more
    finally:
        await runner.aclose()
    final = rest[-1].final
    assert final is not None and final.reason is FinishReason.CANCELLED and final.completion_tokens == 0
    assert not engine.held and session.take() is None  # not kept for the chat's next turn
    assert runner.admission.active == 0


async def test_a_cancel_after_the_first_token_stops_the_sequence_within_one_step_and_frees_it() -> None:
    engine = FakeEngine(step_s=0.01, chat=True)
    runner = Runner(engine, max_active=1, max_queue=0, keepalive_s=5.0)
    session = runner.sessions.open()
    turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=500)), session)
    try:
        async with aclosing(turn.events()) as events:
            first = await asyncio.wait_for(anext(events), 5)
            turn.cancel()
            at_cancel = engine.calls
            rest = [e async for e in events]
            await _until(lambda: not engine.live, "the engine stopped the sequence")
            assert engine.calls - at_cancel <= 2
    finally:
        await runner.aclose()
    assert first.final is None and first.token_ids
    final = rest[-1].final
    assert final is not None and final.reason is FinishReason.CANCELLED
    assert not engine.held and session.take() is None


async def test_closing_the_events_cancels_the_turn() -> None:
    engine = FakeEngine(step_s=0.01)
    runner = Runner(engine, max_active=1, max_queue=0)
    try:
        events = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=500))).events()
        await asyncio.wait_for(anext(events), 5)
        await events.aclose()
        await _until(lambda: not engine.live, "the engine stopped the sequence")
        assert runner.admission.active == 0 and runner.counters.snapshot().sequences_cancelled_total == 1
    finally:
        await runner.aclose()
