"""The flush window in the worker runtime: while busy, tokens after the first wait for the window and share
a frame; the end of the turn (final, cancel) flushes them at once; a lone stream is never held."""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing

from services.common.coalesce import FlushWindow
from services.common.generation import FinishReason, GenerationEvent, GenerationRequest
from services.common.sampling import SamplingParams
from services.worker.runner import Runner
from tests.unit.worker.fakes import TOKENIZER, FakeEngine, reference_events

PROMPT = tuple(TOKENIZER.encode("hi"))
SCRIPT = "hello world, again"
LONG = 10.0  # a window no test waits out: a frame that comes out at all was not held by it


def _reference(max_tokens: int) -> tuple[list[GenerationEvent], GenerationEvent]:
    return reference_events(SCRIPT, PROMPT, SamplingParams(max_tokens=max_tokens))


def _gated_runner(window: FlushWindow) -> tuple[Runner, threading.Semaphore]:
    engine = FakeEngine(SCRIPT)
    engine.gate = gate = threading.Semaphore(1)  # one step now, the others when the test releases them
    return Runner(engine, max_active=2, max_queue=0, keepalive_s=5.0, flush=window), gate


async def test_busy_turn_sends_the_first_token_at_once_then_holds_the_rest_until_the_turn_ends() -> None:
    max_tokens = 8
    reference, final = _reference(max_tokens)
    window = FlushWindow(LONG, busy_streams=1)
    runner, gate = _gated_runner(window)
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=max_tokens))
    try:
        async with aclosing(runner.turn(request).events()) as events:
            first = await asyncio.wait_for(anext(events), 5)
            assert first == reference[0] and window.active == 1
            pending = asyncio.ensure_future(anext(events))
            for _ in range(max_tokens - 2):  # all but the last step: the turn goes on, its tokens wait
                gate.release()
            for _ in range(50):
                await asyncio.sleep(0)
            assert not pending.done()
            gate.release()  # the last step: the turn ends, the held tokens go out at once
            held = await asyncio.wait_for(pending, 5)
            rest = [e async for e in events]
    finally:
        await runner.aclose()
    assert held.final is None
    assert list(held.token_ids) == [t for e in reference[1:] for t in e.token_ids]
    assert held.text == "".join(e.text for e in reference[1:])
    assert rest == [final] and window.active == 0


async def test_cancelling_a_held_turn_flushes_it_at_once() -> None:
    window = FlushWindow(LONG, busy_streams=1)
    runner, gate = _gated_runner(window)
    turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=32)))
    try:
        async with aclosing(turn.events()) as events:
            await asyncio.wait_for(anext(events), 5)
            gate.release()
            pending = asyncio.ensure_future(anext(events))
            for _ in range(50):
                await asyncio.sleep(0)
            turn.cancel()
            for _ in range(32):
                gate.release()  # (a step already waiting on the gate may run; then it stops)
            rest = [await asyncio.wait_for(pending, 5)] + [e async for e in events]
    finally:
        await runner.aclose()
    assert rest[-1].final is not None and rest[-1].final.reason is FinishReason.CANCELLED
    assert all(e.final is None for e in rest[:-1]) and window.active == 0


async def test_a_lone_turn_sends_each_token_as_it_comes() -> None:
    max_tokens = 6
    reference, final = _reference(max_tokens)
    window = FlushWindow(LONG, busy_streams=2)
    runner, gate = _gated_runner(window)
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=max_tokens))
    seen: list[object] = []
    try:
        async with aclosing(runner.turn(request).events()) as events:
            for _ in range(max_tokens):
                seen.append(await asyncio.wait_for(anext(events), 5))  # each at once, not after the window
                gate.release()
            seen += [e async for e in events]
    finally:
        await runner.aclose()
    assert seen == [*reference, final]
