"""Sleep and wake (services/worker/sleep.py) over the real runner and engine loop with a scripted
engine: one load for every waker, a wake every caller left goes back to sleep, Sleep(only_if_idle) is
refused while anything uses the model and is race-free against a turn arriving with it, a turn to an
asleep model wakes it and runs, a host short of memory and a failed load leave it asleep."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import replace

import pytest

from services.common.errors import FailedPrecondition, ResourceExhausted, Unavailable
from services.common.generation import FinishReason, GenerationEvent, GenerationRequest
from services.common.model_state import ModelState
from services.common.sampling import SamplingParams
from services.worker.runner import Runner
from services.worker.sleep import WAKES, HostMemory
from tests.unit.worker.fakes import TOKENIZER, FakeEngine, SleepyEngine

PROMPT = tuple(TOKENIZER.encode("hi"))
MiB = 1 << 20


class FakeMemory(HostMemory):
    """Resident bytes drop by 400 MiB while asleep; ``available`` is what the host has free."""

    def __init__(self, engine: SleepyEngine, available: int = 8 << 30) -> None:
        super().__init__()
        self.engine = engine
        self.available = available

    def resident_bytes(self) -> int:
        return (500 if self.engine.loaded else 100) * MiB

    def available_bytes(self) -> int | None:
        return self.available


def _runner(engine: SleepyEngine, **kw: object) -> Runner:
    runner = Runner(engine, max_active=2, max_queue=8, keepalive_s=0.05, **kw)  # type: ignore[arg-type]
    runner.model.memory = FakeMemory(engine)
    runner.start()
    return runner


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _run(runner: Runner, max_tokens: int = 3) -> list[GenerationEvent]:
    turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=max_tokens)))
    async with aclosing(turn.events()) as events:
        return [e async for e in events if not e.queued]


def _tokens(events: list[GenerationEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


async def test_sleep_releases_and_a_wake_restores_with_the_same_tokens() -> None:
    engine = SleepyEngine()
    runner = _runner(engine)
    try:
        before = _tokens(await _run(runner))
        asleep = await runner.model.sleep(only_if_idle=True)
        assert asleep.state is ModelState.ASLEEP and asleep.resident_bytes == 100 * MiB
        assert runner.model.needed_bytes == 400 * MiB and engine.released == 1
        assert (await runner.model.sleep()).seconds == 0.0  # idempotent
        awake = await runner.model.wake()
        assert awake.state is ModelState.AWAKE and awake.resident_bytes == 500 * MiB
        assert _tokens(await _run(runner)) == before
    finally:
        await runner.aclose()


async def test_many_wakers_share_one_load() -> None:
    engine = SleepyEngine()
    runner = _runner(engine)
    try:
        await runner.model.sleep()
        engine.restore_gate = threading.Event()
        wakers = [asyncio.ensure_future(runner.model.wake()) for _ in range(8)]
        turns = [asyncio.ensure_future(_run(runner)) for _ in range(4)]  # turns share it too
        await _until(lambda: runner.model.state is ModelState.WAKING, "the load starts")
        engine.restore_gate.set()
        results = await asyncio.gather(*wakers)
        assert {r.state for r in results} == {ModelState.AWAKE}
        assert len({r.seconds for r in results}) == 1  # one load's time, shared
        for events in await asyncio.gather(*turns):
            final = events[-1].final
            assert final is not None and final.reason is FinishReason.LENGTH
        assert engine.restored == 1 and runner.model.loads == 1
    finally:
        await runner.aclose()


async def test_a_wake_every_caller_left_goes_back_to_sleep_after_the_load() -> None:
    engine = SleepyEngine()
    runner = _runner(engine)
    abandoned = WAKES.labels("abandoned")._value.get()
    try:
        await runner.model.sleep()
        engine.restore_gate = threading.Event()
        wakers = [asyncio.ensure_future(runner.model.wake()) for _ in range(3)]
        await _until(lambda: runner.model.state is ModelState.WAKING, "the load starts")
        for waker in wakers:
            waker.cancel()
        await asyncio.gather(*wakers, return_exceptions=True)
        engine.restore_gate.set()
        await _until(lambda: engine.restored == 1, "the load completes")
        await _until(lambda: runner.model.state is ModelState.ASLEEP, "back asleep")
        assert engine.released == 2
        assert WAKES.labels("abandoned")._value.get() == abandoned + 1
    finally:
        await runner.aclose()


async def test_a_wake_some_caller_still_waits_for_stays_awake() -> None:
    engine = SleepyEngine()
    runner = _runner(engine)
    try:
        await runner.model.sleep()
        engine.restore_gate = threading.Event()
        gone, staying = asyncio.ensure_future(runner.model.wake()), asyncio.ensure_future(runner.model.wake())
        await _until(lambda: runner.model.state is ModelState.WAKING, "the load starts")
        gone.cancel()
        engine.restore_gate.set()
        assert (await staying).state is ModelState.AWAKE
        await asyncio.sleep(0.05)
        assert runner.model.state is ModelState.AWAKE and engine.released == 1
    finally:
        await runner.aclose()


async def test_sleep_only_if_idle_is_refused_while_a_turn_runs_and_while_a_chat_holds_kv() -> None:
    engine = SleepyEngine(chat=True, step_s=0.01)
    runner = _runner(engine, chat_idle_timeout_s=60.0)
    clock = [0.0]
    runner.sessions.now = lambda: clock[0]
    try:
        turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=200)))
        async with aclosing(turn.events()) as events:
            await anext(events)
            with pytest.raises(FailedPrecondition, match="not idle"):
                await runner.model.sleep(only_if_idle=True)
        assert runner.model.state is ModelState.AWAKE
        session = runner.sessions.open()
        chat = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=2)), session)
        async with aclosing(chat.events()) as events:
            _ = [e async for e in events]
        assert runner.sessions.held == 1
        with pytest.raises(FailedPrecondition, match="chats"):
            await runner.model.sleep(only_if_idle=True)
        clock[0] += 61.0  # the chat is idle-expired: it no longer keeps the model awake
        assert (await runner.model.sleep(only_if_idle=True)).state is ModelState.ASLEEP
        assert not engine.held
    finally:
        await runner.aclose()


async def test_sleep_only_if_idle_and_a_turn_arriving_with_it_never_lose_the_turn() -> None:
    for turn_first in (True, False):
        engine = SleepyEngine()
        runner = _runner(engine)
        try:
            if turn_first:
                turn = asyncio.ensure_future(_run(runner))
                sleep = asyncio.ensure_future(runner.model.sleep(only_if_idle=True))
            else:
                sleep = asyncio.ensure_future(runner.model.sleep(only_if_idle=True))
                turn = asyncio.ensure_future(_run(runner))
            events = await turn
            outcome = await asyncio.gather(sleep, return_exceptions=True)
            assert len(_tokens(events)) == 3  # the turn ran either way
            if isinstance(outcome[0], BaseException):
                assert isinstance(outcome[0], FailedPrecondition)  # the turn came first: refused
            else:
                assert engine.restored == 1  # the sleep came first: the turn woke the model again
            assert runner.model.state is ModelState.AWAKE
        finally:
            await runner.aclose()


async def test_a_forced_sleep_cancels_running_turns_and_drops_held_chats() -> None:
    engine = SleepyEngine(chat=True, step_s=0.01)
    runner = _runner(engine)
    try:
        session = runner.sessions.open()
        chat = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=2)), session)
        async with aclosing(chat.events()) as events:
            _ = [e async for e in events]
        turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=10_000)))
        async with aclosing(turn.events()) as events:
            await anext(events)
            asleep = await runner.model.sleep(only_if_idle=False)
            rest = [e async for e in events]
        assert asleep.state is ModelState.ASLEEP
        final = rest[-1].final
        assert final is not None and final.reason is FinishReason.CANCELLED
        assert runner.sessions.held == 0 and not engine.held and not engine.live
    finally:
        await runner.aclose()


async def test_a_turn_to_an_asleep_model_wakes_it_and_runs() -> None:
    engine = SleepyEngine()
    runner = _runner(engine)
    try:
        before = _tokens(await _run(runner))
        await runner.model.sleep()
        engine.restore_gate = threading.Event()
        turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=3)))
        async with aclosing(turn.events()) as events:
            assert (await anext(events)).queued  # keepalives while the model loads
            engine.restore_gate.set()
            rest = [e async for e in events if not e.queued]
        assert _tokens(rest) == before
        assert runner.model.state is ModelState.AWAKE and engine.restored == 1
    finally:
        await runner.aclose()


async def test_a_turn_cancelled_while_the_model_wakes_ends_cancelled_and_the_model_sleeps_again() -> None:
    engine = SleepyEngine()
    runner = _runner(engine)
    try:
        await runner.model.sleep()
        engine.restore_gate = threading.Event()
        turn = runner.turn(GenerationRequest(PROMPT, SamplingParams(max_tokens=3)))
        async with aclosing(turn.events()) as events:
            assert (await anext(events)).queued
            turn.cancel()
            rest = [e async for e in events]
        final = rest[-1].final
        assert final is not None and final.reason is FinishReason.CANCELLED
        engine.restore_gate.set()
        await _until(lambda: engine.restored == 1, "the load completes")
        await _until(lambda: runner.model.state is ModelState.ASLEEP, "back asleep: nobody waits")
    finally:
        await runner.aclose()


async def test_a_host_short_of_memory_refuses_the_wake_and_the_worker_stays_asleep() -> None:
    engine = SleepyEngine()
    runner = _runner(engine)
    memory = runner.model.memory
    assert isinstance(memory, FakeMemory)
    try:
        await runner.model.sleep()
        memory.available = 300 * MiB  # the model took 400 MiB awake
        with pytest.raises(ResourceExhausted, match="MiB"):
            await runner.model.wake()
        with pytest.raises(ResourceExhausted):
            await _run(runner)  # a turn gets the same answer (the router tries another replica)
        assert runner.model.state is ModelState.ASLEEP and engine.restored == 0
        memory.available = 8 << 30
        assert (await runner.model.wake()).state is ModelState.AWAKE
    finally:
        await runner.aclose()


async def test_a_failed_load_is_unavailable_and_the_worker_stays_asleep() -> None:
    engine = SleepyEngine()
    runner = _runner(engine)
    try:
        await runner.model.sleep()
        engine.restore_error = OSError("the model directory is gone")
        with pytest.raises(Unavailable, match="failed to load"):
            await runner.model.wake()
        assert runner.model.state is ModelState.ASLEEP
        engine.restore_error = None
        assert (await runner.model.wake()).state is ModelState.AWAKE
        assert len(_tokens(await _run(runner))) == 3
    finally:
        await runner.aclose()


async def test_an_engine_that_declares_no_sleep_refuses_it() -> None:
    runner = Runner(FakeEngine(), max_active=1, max_queue=0)
    runner.start()
    try:
        with pytest.raises(FailedPrecondition, match="cannot release"):
            await runner.model.sleep()
        with pytest.raises(FailedPrecondition):
            await runner.model.wake()
    finally:
        await runner.aclose()


async def test_state_changes_call_the_hooks_in_order() -> None:
    engine = SleepyEngine()
    runner = _runner(engine)
    seen: list[ModelState] = []
    runner.model.on_change.append(seen.append)
    try:
        await runner.model.sleep()
        await runner.model.wake()
        assert seen == [ModelState.FALLING_ASLEEP, ModelState.ASLEEP, ModelState.WAKING, ModelState.AWAKE]
    finally:
        await runner.aclose()


async def test_the_memory_check_counts_every_process_that_loads_the_model_alike() -> None:
    engine = SleepyEngine()
    engine._caps = replace(engine.capabilities, load_processes=3)  # a tensor-parallel group of 3 ranks
    runner = _runner(engine)
    memory = runner.model.memory
    assert isinstance(memory, FakeMemory)
    try:
        await runner.model.sleep()
        memory.available = 1000 * MiB  # enough for this rank's 400 MiB, not for the group's 1200
        with pytest.raises(ResourceExhausted, match="needs about 1264 MiB"):
            await runner.model.wake()
        assert runner.model.state is ModelState.ASLEEP and engine.restored == 0
        memory.available = 1300 * MiB
        assert (await runner.model.wake()).state is ModelState.AWAKE
    finally:
        await runner.aclose()
