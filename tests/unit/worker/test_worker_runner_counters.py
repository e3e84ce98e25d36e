"""The runner's sequence counters (the load report's sequences_started_total / _cancelled_total): every
turn that counted as started and did not run to its end counts as cancelled, however it was stopped."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from services.common.generation import FinishReason, GenerationRequest
from services.common.sampling import SamplingParams
from services.worker.runner import Runner, Turn
from tests.unit.worker.fakes import TOKENIZER, FakeEngine

PROMPT = tuple(TOKENIZER.encode("hi"))


def _request(max_tokens: int = 50) -> GenerationRequest:
    return GenerationRequest(PROMPT, SamplingParams(max_tokens=max_tokens))


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Bounded wait (5 s) for state the runner changes in tasks and threads of its own."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _running(runner: Runner, engine: FakeEngine) -> asyncio.Task[list[object]]:
    """A turn holding the only slot, its engine held mid-generation by the gate."""
    engine.gate = threading.Semaphore(0)

    async def run() -> list[object]:
        async with aclosing(runner.turn(_request()).events()) as events:
            return [e async for e in events]

    task = asyncio.create_task(run())
    await _until(lambda: runner.admission.active == 1, "the first turn holds the slot")
    return task


async def _queued(runner: Runner) -> tuple[Turn, AsyncGenerator[object, None]]:
    """A second turn and its events, suspended at its first keepalive: it waits for the slot."""
    turn = runner.turn(_request())
    events = turn.events()
    assert (await asyncio.wait_for(anext(events), 5)).queued
    return turn, events


async def _release(engine: FakeEngine, holder: asyncio.Task[list[object]]) -> list[object]:
    assert engine.gate is not None
    engine.gate.release(100)
    return await asyncio.wait_for(holder, 10)


async def test_a_queued_turn_whose_events_are_closed_counts_as_cancelled() -> None:
    # What a router's abort does to a turn still waiting for a slot (the worker's stream task is
    # cancelled, closing the events): it was counted as started and must be counted as cancelled.
    engine = FakeEngine()
    runner = Runner(engine, max_active=1, max_queue=1, keepalive_s=0.02)
    try:
        holder = await _running(runner, engine)
        _, events = await _queued(runner)
        await events.aclose()
        snapshot = runner.counters.snapshot()
        assert (snapshot.sequences_started_total, snapshot.sequences_cancelled_total) == (2, 1)
        # its place in the queue is given up once the cancelled acquire has run
        await _until(lambda: runner.admission.queued == 0, "the closed turn left the queue")
        done = await _release(engine, holder)
        assert done[-1].final is not None and done[-1].final.reason is FinishReason.LENGTH
    finally:
        await runner.aclose()
    snapshot = runner.counters.snapshot()
    assert (snapshot.sequences_started_total, snapshot.sequences_cancelled_total) == (2, 1)


async def test_a_queued_turns_task_cancelled_counts_as_cancelled() -> None:
    engine = FakeEngine()
    runner = Runner(engine, max_active=1, max_queue=1, keepalive_s=5.0)
    try:
        holder = await _running(runner, engine)

        async def consume() -> None:
            async with aclosing(runner.turn(_request()).events()) as events:
                async for _ in events:
                    pass

        waiting = asyncio.create_task(consume())
        await _until(lambda: runner.admission.queued == 1, "the second turn waits for the slot")
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        snapshot = runner.counters.snapshot()
        assert (snapshot.sequences_started_total, snapshot.sequences_cancelled_total) == (2, 1)
        await _release(engine, holder)
    finally:
        await runner.aclose()


async def test_a_turn_cancelled_while_queued_and_one_cancelled_while_running_count_once_each() -> None:
    engine = FakeEngine()
    runner = Runner(engine, max_active=1, max_queue=1, keepalive_s=0.02)
    try:
        holder = await _running(runner, engine)
        queued, events = await _queued(runner)
        queued.cancel()  # the cancel flag, not a close: the turn ends with its CANCELLED final
        rest = [e async for e in events]
        assert rest[-1].final is not None and rest[-1].final.reason is FinishReason.CANCELLED
        holder.cancel()  # and the running one: closing its events ends it CANCELLED at once
        await asyncio.gather(holder, return_exceptions=True)
        assert engine.gate is not None
        engine.gate.release(100)
        await _until(lambda: runner.counters.snapshot().sequences_cancelled_total == 2, "both counted")
        snapshot = runner.counters.snapshot()
        assert (snapshot.sequences_started_total, snapshot.sequences_cancelled_total) == (2, 2)
    finally:
        await runner.aclose()


async def test_a_slot_granted_just_as_the_queued_turn_is_closed_is_passed_on() -> None:
    # The slot comes while the turn's caller holds its keepalive (the generator suspended at the
    # keepalive); the caller then closes it. The slot must not stay taken for good.
    engine = FakeEngine()
    runner = Runner(engine, max_active=1, max_queue=1, keepalive_s=0.02)
    try:
        holder = await _running(runner, engine)
        _, events = await _queued(runner)  # suspended at the keepalive
        await _release(engine, holder)  # the holder ends: its slot goes to the queued turn's acquire
        await _until(lambda: runner.admission.queued == 0, "the slot was handed to the queued turn")
        await asyncio.sleep(0.05)  # a few loop turns: the turn's acquire() returns True meanwhile
        assert runner.admission.active == 1
        await events.aclose()
        await _until(lambda: runner.admission.active == 0, "the closed turn's slot is free again")
        snapshot = runner.counters.snapshot()
        assert (snapshot.sequences_started_total, snapshot.sequences_cancelled_total) == (2, 1)
        # and the worker still serves
        async with aclosing(runner.turn(_request(max_tokens=3)).events()) as again:
            final = [e async for e in again][-1]
        assert final.final is not None and final.final.reason is FinishReason.LENGTH
    finally:
        await runner.aclose()
