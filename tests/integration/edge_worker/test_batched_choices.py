"""n choices on the batched edge engine (``start_n``): one prefill, KV copied into each choice's slot."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest

from services.common.errors import InvalidArgument
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.batched import BatchedEngine
from services.edge_worker.sequence import BatchedSequence
from tests.integration.edge_worker.test_batched_engine import chat, generate, steps, together

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine() -> Iterator[BatchedEngine]:
    engine = BatchedEngine(
        model_paths().edge_dir, model_id="t", threads=1, max_batch=4, kv_capacity=16, prefill_chunk=16
    )
    yield engine
    engine.close()


def run_choices(seqs: list[BatchedSequence], count: int) -> list[list[int]]:
    try:
        return together([partial(steps, seq, count) for seq in seqs])
    finally:
        for seq in seqs:
            seq.close()


def test_greedy_choices_share_one_prefill_and_equal_the_single_output(engine: BatchedEngine) -> None:
    prompt = chat(engine, "Tell me a short story about a cat.")  # > 16 tokens: two prefill chunks
    single = generate(engine, prompt, 10)
    calls = engine.prefill_calls
    forks = engine.forks_made
    choices = run_choices(engine.start_n(prompt, SamplingParams(max_tokens=10, n=3), 3), 10)
    chunks = -(-len(prompt) // engine.prefill_chunk)
    assert engine.prefill_calls - calls == chunks  # the prompt ran once, not three times
    assert engine.forks_made - forks == 2
    assert choices == [single, single, single]


def test_seeded_choices_are_reproducible_and_choice_i_samples_with_seed_plus_i(engine: BatchedEngine) -> None:
    prompt = chat(engine, "Name three colours.")
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3)
    first = run_choices(engine.start_n(prompt, sampling, 3), 8)
    again = run_choices(engine.start_n(prompt, sampling, 3), 8)
    assert first == again
    assert len({tuple(c) for c in first}) > 1  # different seeds: the choices differ
    alone = [generate(engine, prompt, 8, sampling.choice(i)) for i in range(3)]
    assert first == alone


def test_closing_the_first_choice_before_its_prefill_fails_the_others_at_once(engine: BatchedEngine) -> None:
    seqs = engine.start_n(chat(engine, "Count to five."), SamplingParams(max_tokens=4, n=2), 2)
    seqs[0].close()
    with pytest.raises(Exception, match="prefill did not complete"):
        seqs[1].step()
    seqs[1].close()
    assert generate(engine, chat(engine, "Count to five."), 3)  # the engine goes on


def test_more_choices_than_rows_is_a_clear_error(engine: BatchedEngine) -> None:
    with pytest.raises(InvalidArgument, match="at most 4 choices"):
        engine.start_n([1, 2, 3], SamplingParams(max_tokens=4, n=5), 5)


def test_sampled_choices_each_keep_their_own_grammar_and_logprobs(engine: BatchedEngine) -> None:
    """n with structured output and logprobs: every choice (forks included) is held to the regex by its
    own grammar state and reports one logprob entry per token it generated."""
    import re

    from services.common.constraints import check_constraint

    prompt = chat(engine, "What is today's date?")
    sampling = SamplingParams(
        max_tokens=12,
        temperature=1.0,
        seed=3,
        n=3,
        structured=check_constraint("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        logprobs=True,
        top_logprobs=2,
    )
    seqs = engine.start_n(prompt, sampling, 3)
    entries: list[list[object]] = [[] for _ in seqs]

    def run(i: int) -> list[int]:
        out: list[int] = []
        for _ in range(12):
            token = seqs[i].step()
            if token in engine.info.eos_token_ids:
                break
            out.append(token)
            entries[i].append(seqs[i].last_logprobs)
        return out

    try:
        outputs = together([partial(run, i) for i in range(3)])
    finally:
        for seq in seqs:
            seq.close()
    for out, got in zip(outputs, entries, strict=True):
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", engine.tokenizer.decode(out))
        assert len(got) == len(out) and all(e is not None and len(e.top_ids) == 2 for e in got)  # type: ignore[attr-defined]
