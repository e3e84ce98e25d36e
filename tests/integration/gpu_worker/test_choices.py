"""n choices on the cloud engine (``NewSequence.fork_of``): one prefill, the prompt's full blocks shared by
reference, the partial last block copied; greedy choices equal the single-stream output (eager and
static steps)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from benchmarks.engine_stepper import EngineStepper
from services.common.constraints import check_constraint
from services.common.errors import InvalidArgument
from services.common.generation import FinishReason
from services.common.sampling import SamplingParams
from services.gpu_worker.engine import CloudEngine
from tests.integration.gpu_worker.test_cloud_engine import CHAT, STORY, encode, engine, generate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["off", "on"])
def cloud(request: pytest.FixtureRequest) -> Iterator[CloudEngine]:
    e = engine(decode_graphs=request.param, max_batch=4, prefix_cache=False)
    yield e
    e.close()


def choices(e: CloudEngine, ids: list[int], sampling: SamplingParams, n: int) -> list[list[int]]:
    driver = EngineStepper(e)
    seqs = driver.choices(ids, sampling, n)
    done = driver.run(seqs)
    return [done[i].tokens for i in seqs]


def test_greedy_choices_prefill_once_and_equal_the_single_stream(cloud: CloudEngine) -> None:
    ids = encode(cloud, STORY * 3)  # ~50 tokens: whole blocks shared, a partial last block copied
    assert len(ids) % cloud.block_tokens
    single = generate(cloud, ids, 8)
    before = cloud.prefix_counters()["computed"]
    forks = cloud.scheduler.forks_made
    driver = EngineStepper(cloud)
    seqs = driver.choices(ids, SamplingParams(max_tokens=8, n=3), 3)
    driver.step()  # the prompt fits one step: every choice has its first token
    full = len(ids) // cloud.block_tokens
    states = [cloud._states[i][0] for i in seqs]
    assert all(s.blocks[:full] == states[0].blocks[:full] for s in states)  # shared by reference
    assert len({s.blocks[full] for s in states}) == 3  # the partial block: one copy each
    done = driver.run(seqs)
    assert [done[i].prefill_tokens for i in seqs] == [len(ids), 0, 0]
    assert cloud.prefix_counters()["computed"] - before == len(ids)  # the prompt ran once, not 3 times
    assert cloud.scheduler.forks_made - forks == 2
    assert [done[i].tokens for i in seqs] == [single, single, single]
    assert cloud.kv_usage().used_bytes == 0  # every reference released, shared blocks included


def test_seeded_choices_are_reproducible_and_equal_seed_plus_i_alone(cloud: CloudEngine) -> None:
    ids = encode(cloud, CHAT)
    sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3)
    first = choices(cloud, ids, sampling, 3)
    assert first == choices(cloud, ids, sampling, 3)
    assert len({tuple(c) for c in first}) > 1
    assert first[2] == generate(cloud, ids, sampling=sampling.choice(2))


def test_stopping_the_first_choice_before_its_prefill_ends_cancels_the_others(cloud: CloudEngine) -> None:
    driver = EngineStepper(cloud)
    seqs = driver.choices(encode(cloud, "Cancelled. " + STORY * 6), SamplingParams(max_tokens=4, n=3), 3)
    driver.step()  # one chunk of the ~100-token prompt (64-token step budget)
    assert cloud.kv_usage().used_bytes > 0  # the forks' blocks are reserved with the first choice's
    driver.stop(seqs[0])
    assert cloud.kv_usage().used_bytes == 0
    done = driver.run(seqs[1:])
    assert all(r.finish == FinishReason.CANCELLED and not r.tokens for r in done.values())
    # Stopped before any step: the same.
    seqs = driver.choices(encode(cloud, STORY), SamplingParams(max_tokens=4, n=2), 2)
    driver.stop(seqs[0])
    assert driver.run(seqs[1:])[seqs[1]].finish == FinishReason.CANCELLED
    assert cloud.kv_usage().used_bytes == 0


def test_a_made_fork_outlives_its_source(cloud: CloudEngine) -> None:
    driver = EngineStepper(cloud)
    ids = encode(cloud, STORY)
    seqs = driver.choices(ids, SamplingParams(max_tokens=40, n=2), 2)
    driver.run_until(seqs[1])
    driver.stop(seqs[0])
    assert cloud.kv_usage().used_bytes > 0  # the fork holds the shared blocks now
    assert driver.run([seqs[1]])[seqs[1]].tokens == generate(cloud, ids, 40)
    assert cloud.kv_usage().used_bytes == 0


def test_choices_beyond_the_kv_budget_are_invalid_argument(cloud: CloudEngine) -> None:
    driver = EngineStepper(cloud)
    with pytest.raises(InvalidArgument, match="lower n or max_tokens"):
        driver.choices([1, 2, 3], SamplingParams(max_tokens=1000, n=16), 16)
    assert len(driver.results) == 2  # choices 0 and 1 fit (the runtime stops a turn's others on a refusal)
    driver.close()
    assert cloud.kv_usage().used_bytes == 0 and cloud.next_step_in() is None


def test_sampled_choices_each_keep_their_own_grammar_and_logprobs(cloud: CloudEngine) -> None:
    """n with structured output and logprobs (eager and static steps): every choice, the forks' first
    token included, is held to the regex by its own grammar state and reports one logprob per token."""
    pattern = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    sampling = SamplingParams(
        max_tokens=12,
        temperature=1.0,
        seed=3,
        n=3,
        structured=check_constraint("regex", pattern),
        logprobs=True,
        top_logprobs=2,
    )
    driver = EngineStepper(cloud)
    seqs = driver.choices(encode(cloud, STORY), sampling, 3)
    done = driver.run(seqs)
    eos = cloud.info.eos_token_ids
    for seq in seqs:
        result = done[seq]
        out = [t for t in result.tokens if t not in eos]
        assert re.fullmatch(pattern, cloud.tokenizer.decode(out))
        assert len(result.logprobs) == len(result.tokens) and all(len(e.top_ids) == 2 for e in result.logprobs)
