"""Keepalives while a turn prefills: a resumed (or long) prefill sends keepalives until its first token."""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing

from services.common.generation import FinishReason, GenerationRequest
from services.common.sampling import SamplingParams
from services.worker.runner import Runner
from services.worker.types import NewSequence
from tests.unit.worker.fakes import TOKENIZER, FakeEngine

PROMPT = tuple(TOKENIZER.encode("hi"))
RESUMED = tuple(TOKENIZER.encode("hello"))


class SlowPrefillEngine(FakeEngine):
    """Adding a sequence (the prefill of prompt + replay, on the loop thread) blocks until ``prefilled`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.prefilled = threading.Event()
        self.prefilling = threading.Event()

    def add(self, seq: NewSequence) -> None:
        self.prefilling.set()
        assert self.prefilled.wait(10), "test never released the prefill"
        super().add(seq)


async def test_a_resumed_turn_sends_keepalives_while_its_replay_prefills_then_only_tokens() -> None:
    engine = SlowPrefillEngine()
    runner = Runner(engine, max_active=1, max_queue=0, keepalive_s=0.02)
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=4), resume_ids=RESUMED)
    try:
        async with aclosing(runner.turn(request).events()) as events:
            keepalives = []
            for _ in range(3):
                keepalives.append(await asyncio.wait_for(anext(events), 5))
            # The turn holds the only slot (nothing waits in the queue): these came from the prefill.
            assert all(e.queued for e in keepalives)
            assert (runner.admission.active, runner.admission.queued) == (1, 0) and engine.prefilling.is_set()
            engine.prefilled.set()
            rest = [e async for e in events]
    finally:
        engine.prefilled.set()
        await runner.aclose()
    first_token = next(i for i, e in enumerate(rest) if not e.queued)
    after = rest[first_token:]
    assert not any(e.queued for e in after)  # keepalives end with the first token
    assert after[-1].final is not None and after[-1].final.reason is FinishReason.LENGTH
    assert after[-1].final.completion_tokens == 4 - len(RESUMED)  # max_tokens covers the resumed tokens
    assert engine.started[-1][0] == [*PROMPT, *RESUMED]  # prefilled the prompt and the replayed tokens


async def test_a_fast_turn_sends_no_keepalive() -> None:
    runner = Runner(FakeEngine(), max_active=1, max_queue=0, keepalive_s=5.0)
    try:
        async with aclosing(runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=3))).events()) as events:
            seen = [e async for e in events]
    finally:
        await runner.aclose()
    assert not any(e.queued for e in seen)
    assert seen[-1].final is not None and seen[-1].final.completion_tokens == 3
