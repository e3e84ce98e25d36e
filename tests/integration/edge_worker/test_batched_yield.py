"""Background sequences (batch lines) yield to other turns' prefill in the batched edge engine, on the
real INT4 model: a round that prefills an interactive prompt leaves them out, their tokens are the
same as without yielding, and they go on once the prompt is in."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.batched import BatchedEngine
from services.worker.types import StepInterrupted

pytestmark = pytest.mark.integration
LONG_PROMPT = " ".join(f"item {i}," for i in range(60)) + " and that is the list."


@pytest.fixture(scope="module")
def engine() -> Iterator[BatchedEngine]:
    # A small prefill chunk: the interactive prompt takes several rounds to prefill.
    engine = BatchedEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=4, prefill_chunk=16)
    yield engine
    engine.close()


def ids(engine: BatchedEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text).ids)


def test_background_rows_sit_out_every_round_of_an_interactive_prefill(engine: BatchedEngine) -> None:
    background_prompt = ids(engine, "The sea was calm that morning, and the old fisherman")
    alone = engine.start(background_prompt, SamplingParams(max_tokens=40))
    try:
        expected = [alone.step() for _ in range(40)]
    finally:
        alone.close()

    events: list[str] = []
    lock = threading.Lock()
    first_token = threading.Event()
    tokens: list[int] = []

    def background() -> None:
        seq = engine.start(background_prompt, SamplingParams(max_tokens=40))
        seq.background = True
        try:
            for _ in range(40):
                tokens.append(seq.step())
                with lock:
                    events.append("bg")
        finally:
            seq.close()

    prompt = ids(engine, LONG_PROMPT)
    assert len(prompt) > 4 * 16  # several prefill rounds
    yields_before = engine.yields
    worker = threading.Thread(target=background)
    worker.start()
    try:
        while len(tokens) < 5:  # the background line is decoding
            time.sleep(0.005)
        seq = engine.start(prompt, SamplingParams(max_tokens=2))
        try:
            with lock:
                events.append("fg_start")
            seq.step()
            with lock:
                events.append("fg_first")
            first_token.set()
            seq.step()
        finally:
            seq.close()
    finally:
        worker.join(timeout=60)
    during = events[events.index("fg_start") : events.index("fg_first")].count("bg")
    assert during <= 1  # only the round already running when the prompt came
    assert engine.yields - yields_before >= 4
    assert tokens == expected  # yielding changes when a row runs, never what it computes


def test_a_held_background_sequence_is_cancelled_at_once_and_runs_when_the_flag_is_cleared(
    engine: BatchedEngine,
) -> None:
    engine.hold.max_hold_s = 60.0  # only the flag's end, or a cancel, may end this hold
    outcome: list[object] = []

    def step(seq: object) -> None:
        try:
            outcome.append(seq.step())  # type: ignore[attr-defined]
        except StepInterrupted as exc:
            outcome.append(exc)

    try:
        engine.hold_background(time.monotonic() + 60)  # the host's flag: another worker runs a foreground turn
        seq = engine.start(ids(engine, "Line one."), SamplingParams(max_tokens=4))
        seq.background = True
        waiting = threading.Thread(target=step, args=(seq,))
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive() and not outcome  # held: no prefill, no token
        seq.interrupt()  # the line's caller went away
        waiting.join(timeout=30)
        assert not waiting.is_alive() and isinstance(outcome[0], StepInterrupted)
        seq.close()

        seq = engine.start(ids(engine, "Line two."), SamplingParams(max_tokens=4))
        seq.background = True
        waiting = threading.Thread(target=step, args=(seq,))
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive()
        engine.hold_background(0.0)  # the router's foreground turns ended
        waiting.join(timeout=30)
        assert not waiting.is_alive() and isinstance(outcome[1], int)
        seq.close()
    finally:
        engine.hold_background(0.0)
        engine.hold.max_hold_s = 2.0


@pytest.fixture(scope="module")
def long_prefill_engine() -> Iterator[BatchedEngine]:
    # One prefill call for a whole long prompt (hundreds of ms on one thread): long enough to stop part-way.
    engine = BatchedEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=4, prefill_chunk=2048)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ledger(long_prefill_engine: BatchedEngine) -> tuple[list[int], list[int]]:
    """A prompt of over 1,000 tokens and its 6 greedy tokens run alone (the reference of both arrivals)."""
    engine = long_prefill_engine
    prompt = ids(engine, " ".join(f"entry {i} of the ledger," for i in range(160)))
    assert len(prompt) > 1000
    alone = engine.start(prompt, SamplingParams(max_tokens=6))
    try:
        return prompt, [alone.step() for _ in range(6)]
    finally:
        alone.close()


@pytest.mark.parametrize("arrival", ["host_flag", "foreground_step"])
def test_a_background_call_running_when_foreground_work_arrives_is_stopped_and_run_again_whole(
    long_prefill_engine: BatchedEngine, ledger: tuple[list[int], list[int]], arrival: str
) -> None:
    engine = long_prefill_engine
    prompt, expected = ledger

    tokens: list[int] = []
    errors: list[BaseException] = []

    def background() -> None:
        seq = engine.start(prompt, SamplingParams(max_tokens=6))
        seq.background = True
        try:
            for _ in range(6):
                tokens.append(seq.step())
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            seq.close()

    before = engine.hold.preemptions
    line = threading.Thread(target=background)
    line.start()
    try:
        deadline = time.monotonic() + 30
        while not engine.preemptible:  # the line's (long) prefill call is running
            assert time.monotonic() < deadline and line.is_alive()
            time.sleep(0.001)
        if arrival == "host_flag":
            engine.hold_background(time.monotonic() + 0.3)  # the router starts a turn on another worker
        else:
            fg = engine.start(ids(engine, "Hello there."), SamplingParams(max_tokens=2))
            try:
                fg.step()
                fg.step()
            finally:
                fg.close()
        line.join(timeout=60)
    finally:
        engine.hold_background(0.0)
    assert not line.is_alive() and not errors
    assert engine.hold.preemptions == before + 1  # the prefill call was stopped once, then run again whole
    assert tokens == expected  # the stopped call left nothing behind: the same greedy tokens
