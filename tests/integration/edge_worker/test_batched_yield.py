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
