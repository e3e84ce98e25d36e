"""n choices on the cloud engine (``start_n``): one prefill, the prompt's full blocks shared by reference,
the partial last block copied; greedy choices equal the single-stream output (eager and static steps)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from services.common.errors import InvalidArgument
from services.common.sampling import SamplingParams
from services.gpu_worker.engine import CloudEngine, CloudSequence
from tests.integration.gpu_worker.test_cloud_engine import STORY, encode, engine, generate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["off", "on"])
def cloud(request: pytest.FixtureRequest) -> Iterator[CloudEngine]:
    e = engine(decode_graphs=request.param, max_batch=4, prefix_cache=False)
    yield e
    e.close()


def run(seqs: list[CloudSequence], count: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in seqs]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            while len(out[i]) < count:
                out[i].append(seqs[i].step())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)
        finally:
            seqs[i].close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


def test_greedy_choices_prefill_once_and_equal_the_single_stream(cloud: CloudEngine) -> None:
    ids = encode(cloud, STORY * 3)  # ~50 tokens: whole blocks shared, a partial last block copied
    assert len(ids) % cloud.block_tokens
    single = generate(cloud, ids, 8)
    before = cloud.prefix_counters()["computed"]
    forks = cloud.scheduler.forks_made
    choices = run(cloud.start_n(ids, SamplingParams(max_tokens=8, n=3), 3), 8)
    assert cloud.prefix_counters()["computed"] - before == len(ids)  # the prompt ran once, not 3 times
    assert cloud.scheduler.forks_made - forks == 2
    assert choices == [single, single, single]
    assert cloud.kv_usage().used_bytes == 0  # every reference released, shared blocks included


def test_seeded_choices_are_reproducible_and_equal_seed_plus_i_alone(cloud: CloudEngine) -> None:
    ids = encode(cloud, "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n")
    sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3)
    first = run(cloud.start_n(ids, sampling, 3), 6)
    assert first == run(cloud.start_n(ids, sampling, 3), 6)
    assert len({tuple(c) for c in first}) > 1
    assert first[2] == generate_with(cloud, ids, sampling.choice(2), 6)


def generate_with(e: CloudEngine, ids: list[int], sampling: SamplingParams, count: int) -> list[int]:
    return run([e.start(ids, sampling)], count)[0]


def test_closing_the_first_choice_early_fails_the_others_and_frees_their_blocks(cloud: CloudEngine) -> None:
    seqs = cloud.start_n(encode(cloud, STORY), SamplingParams(max_tokens=4, n=3), 3)
    seqs[0].close()  # never stepped: the forks are never made
    for seq in seqs[1:]:
        seq.close()
    assert cloud.kv_usage().used_bytes == 0
    seqs = cloud.start_n(encode(cloud, STORY), SamplingParams(max_tokens=40, n=2), 2)
    seqs[0].step()
    seqs[0].close()
    assert len(run(seqs[1:], 3)[0]) == 3  # a made fork outlives its source
    assert cloud.kv_usage().used_bytes == 0


def test_choices_beyond_the_kv_budget_are_invalid_argument(cloud: CloudEngine) -> None:
    with pytest.raises(InvalidArgument, match="lower n or max_tokens"):
        cloud.start_n([1, 2, 3], SamplingParams(max_tokens=1000, n=16), 16)


def test_forks_of_a_first_choice_closed_before_its_first_step_fail_at_once(cloud: CloudEngine) -> None:
    seqs = cloud.start_n(encode(cloud, STORY), SamplingParams(max_tokens=4, n=2), 2)
    seqs[0].close()
    with pytest.raises(Exception, match="prefill did not complete"):
        seqs[1].step()
    seqs[1].close()


def test_sampled_choices_each_keep_their_own_grammar_and_logprobs(cloud: CloudEngine) -> None:
    """n with structured output and logprobs (eager and static steps): every choice, the forks' first
    token included, is held to the regex by its own grammar state and reports one logprob per token."""
    import re

    from services.common.constraints import check_constraint

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
    seqs = cloud.start_n(encode(cloud, STORY), sampling, 3)
    outputs: list[list[int]] = [[] for _ in seqs]
    entries: list[list[object]] = [[] for _ in seqs]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(12):
                token = seqs[i].step()
                if token in cloud.info.eos_token_ids:
                    break
                outputs[i].append(token)
                entries[i].append(seqs[i].last_logprobs)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)
        finally:
            seqs[i].close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    for out, got in zip(outputs, entries, strict=True):
        assert re.fullmatch(pattern, cloud.tokenizer.decode(out))
        assert len(got) == len(out) and all(e is not None and len(e.top_ids) == 2 for e in got)  # type: ignore[attr-defined]
