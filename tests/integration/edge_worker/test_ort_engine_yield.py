"""Background sequences (batch lines) yield in the batched edge engine, on the real INT4 model: a step
that prefills an interactive prompt leaves them out, the host's foreground flag holds them, a step of
batch work only is stopped part-way when foreground work arrives, and their tokens are the same as
without yielding."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from benchmarks.engine_stepper import EngineStepper, SequenceResult
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.ort_engine import OrtEngine
from services.worker.types import SequenceOutput
from tests.integration.edge_worker.test_ort_engine import generate, ids_of

pytestmark = pytest.mark.integration
LONG_PROMPT = " ".join(f"item {i}," for i in range(60)) + " and that is the list."


@pytest.fixture(scope="module")
def engine() -> Iterator[OrtEngine]:
    # A small prefill chunk: the interactive prompt takes several steps to prefill.
    engine = OrtEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=4, prefill_chunk=16)
    yield engine
    engine.close()


def run_waiting(driver: EngineStepper) -> dict[int, SequenceResult]:
    """Step until every sequence ended, waiting out the delays the engine asks for (held batch lines)."""
    for _ in range(10_000):
        if all(result.ended for result in driver.results.values()):
            return driver.results
        wait = driver.engine.next_step_in()
        assert wait is not None, "the engine has nothing to do but sequences have not ended"
        if wait > 0:
            time.sleep(wait)  # the engine's own deadline (the host flag's expiry), not a readiness poll
        driver.step()
    raise AssertionError("sequences did not end")


def test_background_rows_sit_out_every_step_of_an_interactive_prefill(engine: OrtEngine) -> None:
    background_prompt = ids_of(engine, "The sea was calm that morning, and the old fisherman")
    expected = generate(engine, background_prompt, 40)
    driver = EngineStepper(engine)
    line = driver.add(background_prompt, SamplingParams(max_tokens=40), background=True)
    while len(driver.results[line].tokens) < 5:  # the background line is decoding
        driver.step()
    prompt = ids_of(engine, LONG_PROMPT)
    assert len(prompt) > 4 * 16  # several prefill steps
    yields_before = engine.yields
    fg = driver.add(prompt, SamplingParams(max_tokens=2))
    during = 0
    while not driver.results[fg].tokens:
        during += sum(len(out.tokens) for out in driver.step() if out.id == line)
    assert during == 0  # no step of the prompt's prefill had a background row
    assert engine.yields - yields_before >= 4
    results = driver.run()
    assert results[line].tokens == expected  # yielding changes when a row runs, never what it computes
    assert len(results[fg].tokens) == 2


def test_the_host_flag_holds_a_background_sequence_until_cleared_and_a_stop_frees_it_at_once(
    engine: OrtEngine,
) -> None:
    engine.hold.max_hold_s = 60.0  # only the flag's end, or a stop, may end this hold
    woken: list[bool] = []
    driver = EngineStepper(engine)
    engine.bind(lambda: woken.append(True))  # the engine loop's wake-up
    try:
        engine.hold_background(time.monotonic() + 60)  # the host's flag: another worker runs a foreground turn
        calls = engine.prefill_calls
        first = driver.add(ids_of(engine, "Line one."), SamplingParams(max_tokens=4), background=True)
        assert driver.step() == [] and engine.prefill_calls == calls  # held: no prefill, no token
        wait = engine.next_step_in()
        assert wait is not None and wait > 30  # nothing to run until the flag expires
        driver.stop(first)  # the line's caller went away: freed at once
        assert engine.next_step_in() is None and engine.kv_usage().used_bytes == 0

        second = driver.add(ids_of(engine, "Line two."), SamplingParams(max_tokens=4), background=True)
        assert driver.step() == [] and engine.prefill_calls == calls
        woken.clear()
        engine.hold_background(0.0)  # the router's foreground turns ended
        assert woken  # the loop is told to look again
        assert engine.next_step_in() == 0.0
        result = driver.run([second])[second]
        assert result.tokens and result.finish is not None
    finally:
        engine.hold_background(0.0)
        engine.hold.max_hold_s = 2.0
        engine.bind(lambda: None)


@pytest.fixture(scope="module")
def long_prefill_engine() -> Iterator[OrtEngine]:
    # One prefill call for a whole long prompt (hundreds of ms on one thread): long enough to stop part-way.
    engine = OrtEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=4, prefill_chunk=2048)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ledger(long_prefill_engine: OrtEngine) -> tuple[list[int], list[int]]:
    """A prompt of over 1,000 tokens and its 6 greedy tokens run alone (the reference of both arrivals)."""
    engine = long_prefill_engine
    prompt = ids_of(engine, " ".join(f"entry {i} of the ledger," for i in range(160)))
    assert len(prompt) > 1000
    return prompt, generate(engine, prompt, 6)


@pytest.mark.parametrize("arrival", ["host_flag", "foreground_add"])
def test_a_background_call_running_when_foreground_work_arrives_is_stopped_and_run_again_whole(
    long_prefill_engine: OrtEngine, ledger: tuple[list[int], list[int]], arrival: str
) -> None:
    engine = long_prefill_engine
    prompt, expected = ledger
    driver = EngineStepper(engine)
    line = driver.add(prompt, SamplingParams(max_tokens=6), background=True)
    before = engine.hold.preemptions
    outputs: list[SequenceOutput] = []
    # The engine loop thread's step, while the event loop (this thread) gets foreground work.
    step = threading.Thread(target=lambda: outputs.extend(driver.step()))
    step.start()
    try:
        deadline = time.monotonic() + 30
        while not engine.preemptible:  # the line's (long) prefill call is running
            assert time.monotonic() < deadline and step.is_alive()
            time.sleep(0.001)
        if arrival == "host_flag":
            engine.hold_background(time.monotonic() + 0.3)  # the router starts a turn on another worker
        else:
            engine.interrupt_background()  # what the engine loop does when a foreground turn is added
        step.join(timeout=60)
        assert not step.is_alive() and outputs == []  # the step stopped part-way: no token
        fg = (
            driver.add(ids_of(engine, "Hello there."), SamplingParams(max_tokens=2)) if arrival != "host_flag" else None
        )
        results = run_waiting(driver)
    finally:
        engine.hold_background(0.0)
    assert engine.hold.preemptions == before + 1  # the prefill call was stopped once, then run again whole
    assert results[line].error is None and results[line].tokens == expected  # it left nothing behind
    if fg is not None:
        assert len(results[fg].tokens) == 2


def test_an_interrupt_before_a_step_of_batch_work_only_stops_that_step_at_once(engine: OrtEngine) -> None:
    """The foreground add that comes with the interrupt may reach the loop after its next step began:
    that step (batch work only) stops before it computes anything, and runs again after the add."""
    prompt = ids_of(engine, "The sea was calm that morning, and the old fisherman")
    expected = generate(engine, prompt, 8)
    driver = EngineStepper(engine)
    line = driver.add(prompt, SamplingParams(max_tokens=8), background=True)
    driver.step()
    driver.step()
    rows, before = engine.rows, engine.hold.preemptions
    engine.interrupt_background()  # no step is running: the next one of batch work only stops at once
    assert driver.step() == [] and engine.hold.preemptions == before + 1 and engine.rows == rows
    results = driver.run()  # the interrupt is spent: the next steps run (here no foreground add came)
    assert results[line].tokens == expected
