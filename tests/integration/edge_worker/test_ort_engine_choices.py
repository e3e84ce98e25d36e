"""n choices on the batched edge engine: the first choice prefills, the others are forks of it
(``NewSequence.fork_of``): the prompt's KV copied into each fork's slot, its first token sampled from
the same logits with its own sampling."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from benchmarks.engine_stepper import EngineStepper, SequenceResult
from services.common.constraints import check_constraint
from services.common.generation import FinishReason
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.ort_engine import OrtEngine
from tests.integration.edge_worker.test_ort_engine import chat, generate

pytestmark = pytest.mark.integration
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


@pytest.fixture(scope="module")
def engine() -> Iterator[OrtEngine]:
    engine = OrtEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=4, kv_capacity=16, prefill_chunk=16)
    yield engine
    engine.close()


def run_choices(engine: OrtEngine, prompt: list[int], sampling: SamplingParams, n: int) -> list[SequenceResult]:
    driver = EngineStepper(engine)
    seq_ids = driver.choices(prompt, sampling, n)
    results = driver.run(seq_ids)
    return [results[i] for i in seq_ids]


def test_greedy_choices_share_one_prefill_and_equal_the_single_output(engine: OrtEngine) -> None:
    prompt = chat(engine, "Tell me a short story about a cat.")  # > 16 tokens: two prefill chunks
    single = generate(engine, prompt, 10)
    calls = engine.prefill_calls
    forks = engine.forks_made
    choices = run_choices(engine, prompt, SamplingParams(max_tokens=10, n=3), 3)
    chunks = -(-len(prompt) // engine.prefill_chunk)
    assert engine.prefill_calls - calls == chunks  # the prompt ran once, not three times
    assert engine.forks_made - forks == 2
    assert [c.tokens for c in choices] == [single, single, single]
    assert [c.prefill_tokens for c in choices] == [len(prompt), 0, 0]  # the forks computed nothing themselves


def test_seeded_choices_are_reproducible_and_choice_i_samples_with_seed_plus_i(engine: OrtEngine) -> None:
    prompt = chat(engine, "Name three colours.")
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3)
    first = [c.tokens for c in run_choices(engine, prompt, sampling, 3)]
    again = [c.tokens for c in run_choices(engine, prompt, sampling, 3)]
    assert first == again
    assert len({tuple(c) for c in first}) > 1  # different seeds: the choices differ
    alone = [generate(engine, prompt, 8, sampling.choice(i)) for i in range(3)]
    assert first == alone


@pytest.mark.parametrize("after_steps", [0, 1])
def test_stopping_the_first_choice_before_its_prefill_ended_cancels_the_others(
    engine: OrtEngine, after_steps: int
) -> None:
    prompt = chat(engine, "Tell me a short story about a cat.")  # two chunks: still prefilling after one step
    before = engine.kv_usage().used_bytes
    driver = EngineStepper(engine)
    seq_ids = driver.choices(prompt, SamplingParams(max_tokens=4, n=3), 3)
    for _ in range(after_steps):
        assert driver.step() == []
    driver.stop(seq_ids[0])
    outputs = driver.step()  # the forks' ends come with the next step
    assert {out.id: out.finish for out in outputs} == dict.fromkeys(seq_ids[1:], FinishReason.CANCELLED)
    assert engine.next_step_in() is None and engine.kv_usage().used_bytes == before
    assert generate(engine, chat(engine, "Count to five."), 3)  # the engine goes on


def test_a_fork_with_no_free_slot_fails_alone(engine: OrtEngine) -> None:
    """Every slot held by a sequence of the step: the fork cannot be made; that choice fails with a
    clear error, the first choice and the others go on."""
    others = [chat(engine, p) for p in ("What is the sea?", "Count to five.", "Name three colours.")]
    plain = [generate(engine, p, 6) for p in others]
    driver = EngineStepper(engine)
    running = [driver.add(p, SamplingParams(max_tokens=6)) for p in others]
    driver.step()  # the three hold three of the four slots
    prompt = chat(engine, "Say yes.")
    leader, fork = driver.choices(prompt, SamplingParams(max_tokens=6, n=2), 2)
    results = driver.run()
    assert isinstance(results[fork].error, RuntimeError) and "no KV slot is free" in str(results[fork].error)
    assert results[leader].tokens == generate(engine, prompt, 6)
    assert [results[i].tokens for i in running] == plain


def test_more_forks_than_free_slots_wait_parked_and_still_equal_the_single_output(engine: OrtEngine) -> None:
    """A sequence decoding beside four choices on four slots: a fork made when no slot is free parks
    one made before it in the same step (its KV copied out); the one left out waits in the engine for
    a slot, and every choice still gives the n = 1 tokens."""
    other = chat(engine, "What is the sea?")
    plain = generate(engine, other, 8)
    prompt = chat(engine, "Tell me a short story about a cat.")
    single = generate(engine, prompt, 8)
    forks = engine.forks_made
    driver = EngineStepper(engine)
    running = driver.add(other, SamplingParams(max_tokens=8))
    driver.step()
    seq_ids = driver.choices(prompt, SamplingParams(max_tokens=8, n=4), 4)
    results = driver.run()
    assert engine.forks_made - forks == 3
    assert [results[i].tokens for i in seq_ids] == [single] * 4
    assert results[running].tokens == plain


def test_sampled_choices_each_keep_their_own_grammar_and_logprobs(engine: OrtEngine) -> None:
    """n with structured output and logprobs: every choice (forks included) is held to the regex by its
    own grammar state and reports one logprob entry per token it generated."""
    prompt = chat(engine, "What is today's date?")
    sampling = SamplingParams(
        max_tokens=12,
        temperature=1.0,
        seed=3,
        n=3,
        structured=check_constraint("regex", DATE),
        logprobs=True,
        top_logprobs=2,
    )
    eos = engine.info.eos_token_ids
    for choice in run_choices(engine, prompt, sampling, 3):
        assert choice.finish == FinishReason.STOP and choice.tokens[-1] in eos
        assert re.fullmatch(DATE, engine.tokenizer.decode(choice.tokens[:-1]))
        assert len(choice.logprobs) == len(choice.tokens) and all(len(e.top_ids) == 2 for e in choice.logprobs)
        assert [e.token_id for e in choice.logprobs] == choice.tokens
