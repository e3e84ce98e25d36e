"""A cancel reaches a turn's first step (its prefill) on engines whose sequences can ``interrupt()``."""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing

from services.common.sampling import SamplingParams
from services.worker.interrupt import PrefillInterrupter
from services.worker.runner import Runner
from services.worker.sessions import ChatSession
from services.worker.types import FinalEvent, FinishReason, GenerationRequest, QueuedEvent, StepInterrupted
from tests.unit.worker.fakes import TOKENIZER, FakeEngine, FakeSequence

PROMPT = tuple(TOKENIZER.encode("hi"))


class InterruptibleSequence(FakeSequence):
    """Its first step is a prefill that runs until interrupted (or released by the test)."""

    def __init__(self, engine: FakeEngine, sampling: SamplingParams) -> None:
        super().__init__(engine, sampling)
        self.prefilling = threading.Event()
        self.stop = threading.Event()
        self.interrupts = 0
        self.first = True
        self.block = engine.block_first  # type: ignore[attr-defined]

    def interrupt(self) -> None:
        self.interrupts += 1
        self.stop.set()

    def step(self) -> int:
        if self.first and self.block:
            self.first = False
            self.prefilling.set()
            if self.stop.wait(10):
                raise StepInterrupted("the turn was cancelled")
        return super().step()


class InterruptibleEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.sequences: list[InterruptibleSequence] = []
        self.block_first = True

    def start(self, token_ids, sampling, replay=()):  # type: ignore[no-untyped-def]
        super().start(token_ids, sampling, replay)  # records the start
        seq = InterruptibleSequence(self, sampling)
        self.sequences.append(seq)
        return seq

    start_chat = start


async def test_cancel_during_the_prefill_interrupts_it_and_the_turn_ends_cancelled() -> None:
    engine = InterruptibleEngine()
    runner = Runner(engine, max_active=1, max_queue=0, keepalive_s=0.02)
    session = ChatSession(runner.sessions)
    turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=4)), session)
    try:
        async with aclosing(turn.events()) as events:
            assert isinstance(await asyncio.wait_for(anext(events), 5), QueuedEvent)  # prefilling
            assert engine.sequences[0].prefilling.is_set()
            turn.cancel()
            rest = [e async for e in events]
    finally:
        await runner.aclose()
    final = rest[-1]
    assert isinstance(final, FinalEvent) and final.reason is FinishReason.CANCELLED
    assert final.completion_tokens == 0
    seq = engine.sequences[0]
    assert seq.interrupts == 1 and seq.closed  # not kept for the chat's next turn: it holds the interrupt
    assert session.take() is None


async def test_an_interrupt_fired_before_the_step_is_armed_still_reaches_it() -> None:
    interrupter = PrefillInterrupter()
    hits: list[str] = []
    interrupter.fire()
    interrupter.arm(lambda: hits.append("first"))
    interrupter.disarm()
    interrupter.fire()  # disarmed: nothing to interrupt
    assert hits == ["first"] and interrupter.fired


async def test_a_cancel_after_the_first_token_stops_between_steps_and_keeps_the_chat_sequence() -> None:
    engine = InterruptibleEngine()
    engine.block_first = False
    engine.step_s = 0.02
    runner = Runner(engine, max_active=1, max_queue=0, keepalive_s=5.0)
    session = ChatSession(runner.sessions)
    turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=50)), session)
    try:
        async with aclosing(turn.events()) as events:
            first = await asyncio.wait_for(anext(events), 5)
            turn.cancel()
            rest = [e async for e in events]
    finally:
        await runner.aclose()
    assert not isinstance(first, FinalEvent)
    assert isinstance(rest[-1], FinalEvent) and rest[-1].reason is FinishReason.CANCELLED
    seq = engine.sequences[0]
    assert seq.interrupts == 0 and not seq.closed  # decode steps are short: the stop flag is enough
    assert session.take() is seq
