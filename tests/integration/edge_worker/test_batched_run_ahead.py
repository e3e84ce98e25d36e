"""Steps begun ahead on the batched edge engine (``BatchedSequence.begin(ahead)``), on the real INT4 model:
the batch thread runs a stream's next steps itself, round after round, and the tokens are those of
one step at a time; it stops at EOS, at the budget, and when ``READY_LIMIT`` tokens wait unread (the
next ``wait`` resumes it); closing drops the steps begun; a chat turn's ``reuse`` waits for them; a
cancel through the runtime leaves at most the step in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.batched import BatchedEngine
from services.edge_worker.sequence import READY_LIMIT, BatchedSequence
from services.worker.interrupt import PrefillInterrupter
from services.worker.runner import run_sequence
from services.worker.stats import WorkerCounters
from services.worker.types import FinishReason, GenerationRequest, TokenEvent
from tests.integration.edge_worker.test_batched_engine import PROMPTS, chat, generate, together

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine() -> Iterator[BatchedEngine]:
    engine = BatchedEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=4, kv_capacity=16)
    yield engine
    engine.close()


def ahead(seq: BatchedSequence, n: int) -> list[int]:
    """``n`` >= 2 tokens: the first step, then the other ``n - 1`` begun at once (one and ``n - 2`` ahead)."""
    first = seq.step()
    seq.begin(n - 2)
    return [first, *(seq.wait() for _ in range(n - 1))]


def settled_rows(engine: BatchedEngine) -> int:
    """The engine's decode rows once it has stopped stepping (unchanged for 0.3 s)."""
    rows = -1
    while rows != engine.rows:
        rows = engine.rows
        time.sleep(0.3)
    return rows


def test_steps_begun_ahead_give_the_tokens_of_one_step_at_a_time(engine: BatchedEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS[:3]]
    alone = [generate(engine, p, 12) for p in prompts]

    def run(prompt: list[int]) -> list[int]:
        seq = engine.start(prompt, SamplingParams(max_tokens=12))
        try:
            return ahead(seq, 12)
        finally:
            seq.close()

    assert [run(p) for p in prompts] == alone
    assert together([lambda p=p: run(p) for p in prompts]) == alone  # rows of one batch, each running ahead


def test_the_engine_stops_at_the_budget_and_when_tokens_wait_unread(engine: BatchedEngine) -> None:
    prompt = chat(engine, PROMPTS[2])
    alone = generate(engine, prompt, 10)
    seq = engine.start(prompt, SamplingParams(max_tokens=10))
    try:
        first = seq.step()
        rows = settled_rows(engine)
        seq.begin(8)  # this step and 8 more
        # nobody waits: the batch thread stops once READY_LIMIT tokens are there
        assert settled_rows(engine) - rows == READY_LIMIT
        got = [first, *(seq.wait() for _ in range(9))]  # each wait past the limit resumes it
        assert settled_rows(engine) - rows == 9  # the budget, no step more
    finally:
        seq.close()
    assert got == alone


def test_eos_ends_the_steps_begun(engine: BatchedEngine) -> None:
    prompt = chat(engine, "Say yes.")
    seq = engine.start(prompt, SamplingParams(max_tokens=30))
    try:
        rows = settled_rows(engine)
        tokens = [seq.step()]
        seq.begin(28)
        while tokens[-1] not in engine.info.eos_token_ids:
            tokens.append(seq.wait())
        assert 1 < len(tokens) < 30
        assert settled_rows(engine) - rows == len(tokens) - 1  # decode rows after the prefill's token
    finally:
        seq.close()


def test_closing_with_steps_begun_frees_the_slot_and_leaves_others_alone(engine: BatchedEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS]
    other = generate(engine, prompts[1], 12)
    before = engine.kv_usage().used_bytes
    seq = engine.start(prompts[0], SamplingParams(max_tokens=40))

    def leave_early() -> list[int]:
        first = seq.step()
        seq.begin(38)
        got = [first, seq.wait()]
        seq.close()  # a stop string or a cancel: steps are still begun
        return got

    got = together([leave_early, lambda: generate(engine, prompts[1], 12)])
    assert got[1] == other and len(got[0]) == 2
    settled_rows(engine)
    assert seq.slot is None and engine.kv_usage().used_bytes <= before
    assert generate(engine, prompts[1], 12) == other  # all four slots usable again
    assert together([lambda p=p: generate(engine, p, 3) for p in prompts])


def test_a_chat_turn_after_steps_begun_continues_like_a_fresh_sequence(engine: BatchedEngine) -> None:
    prompt = chat(engine, PROMPTS[0])
    seq = engine.start_chat(prompt, SamplingParams(max_tokens=20))
    try:
        first = seq.step()
        seq.begin(18)
        said = [first, *(seq.wait() for _ in range(4))]  # the turn ends early (a stop string): steps begun
        follow = list(engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd two animals?<|im_end|>\n").ids)
        ids = [*prompt, *said, *follow]
        assert seq.reuse(ids, SamplingParams(max_tokens=6))  # waits for the steps begun, keeps the prefix
        assert seq.prefill_tokens == len(follow)  # the step begun after the turn's last token fed it
        second = ahead(seq, 6)
    finally:
        seq.close()
    assert second == generate(engine, ids, 6)


def test_logprobs_belong_to_the_token_each_wait_returns(engine: BatchedEngine) -> None:
    sampling = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=2)
    seq = engine.start(chat(engine, PROMPTS[3]), sampling)
    try:
        first = seq.step()
        found = [seq.last_logprobs]
        seq.begin(6)
        tokens = [first]
        for _ in range(7):
            tokens.append(seq.wait())
            found.append(seq.last_logprobs)
    finally:
        seq.close()
    assert [entry.token_id for entry in found if entry is not None] == tokens


def test_a_cancel_ends_the_steps_begun_after_the_one_in_flight(engine: BatchedEngine) -> None:
    prompt = chat(engine, PROMPTS[2])
    stop, interrupter = threading.Event(), PrefillInterrupter()
    emitted: list[TokenEvent] = []
    rows_at_cancel: list[int] = []

    def cancel() -> None:  # as the event loop does, while the worker thread waits for the next token
        rows_at_cancel.append(engine.rows)
        stop.set()
        interrupter.fire()

    def emit(event: TokenEvent) -> None:  # the client leaves after its second token
        emitted.append(event)
        if len(emitted) == 2:
            threading.Timer(0.003, cancel).start()

    request = GenerationRequest(tuple(prompt), SamplingParams(max_tokens=40))
    final = run_sequence(engine, request, stop, emit, WorkerCounters(), None, interrupter)
    assert final.reason == FinishReason.CANCELLED and len(emitted) in (2, 3)  # a token may beat the cancel
    assert settled_rows(engine) - rows_at_cancel[0] <= 1  # the decode step in flight, no more
    assert generate(engine, prompt, 4) == generate(engine, prompt, 4)  # the engine goes on
