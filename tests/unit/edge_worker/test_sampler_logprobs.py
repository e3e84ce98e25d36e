"""The edge sampler's logprobs on hand-made logits: equal to a reference log-softmax (float64), top-k
most likely first with ties by id, of the penalised row the token was drawn from."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.sampling import SamplingParams
from services.edge_worker.sampler import logprobs, pick
from services.worker.penalties import Penalties


def reference(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_logprobs_equal_a_reference_log_softmax(top: int) -> None:
    row = np.random.default_rng(7).standard_normal(49152).astype(np.float32) * 4
    token = int(np.argmax(row))
    got = logprobs(row, token, top)
    want = reference(row)
    assert got.token_id == token
    assert got.logprob == pytest.approx(want[token], abs=1e-5)
    order = np.argsort(-want, kind="stable")[:top]
    assert list(got.top_ids) == order.tolist()
    np.testing.assert_allclose(got.top_logprobs, want[order], atol=1e-5)
    assert list(got.top_logprobs) == sorted(got.top_logprobs, reverse=True)
    assert sum(np.exp(want)) == pytest.approx(1.0)
    scratch = row.copy()
    again = logprobs(scratch, token, top, in_place=True)  # the engine's way: in the sequence's scratch row
    assert (again.logprob, list(again.top_ids)) == (got.logprob, list(got.top_ids))


def test_ties_are_listed_by_id_and_a_sampled_token_need_not_be_the_best() -> None:
    row = np.array([1.0, 3.0, 3.0, 0.5, 3.0], dtype=np.float32)
    got = logprobs(row, 3, 3)
    assert list(got.top_ids) == [1, 2, 4]
    assert got.logprob == pytest.approx(reference(row)[3], abs=1e-6)


def test_logprobs_are_of_the_penalised_row() -> None:
    sampling = SamplingParams(max_tokens=4, logit_bias=((1, -100.0),), logprobs=True, top_logprobs=2)
    row = np.array([0.0, 5.0, 4.0, 1.0], dtype=np.float32)
    adjusted = Penalties(sampling, [], {0}).apply(row.copy())
    token = pick(adjusted, sampling, None)
    got = logprobs(adjusted, token, 2)
    assert token == 2 and list(got.top_ids) == [2, 3]
    assert got.logprob == pytest.approx(reference(adjusted)[2], abs=1e-6)


def test_a_peaked_row_still_lists_the_top_tokens() -> None:
    """One logit far above the rest; ties at the last place go to the lowest id."""
    row = np.zeros(1000, dtype=np.float32)
    row[7], row[3], row[500] = 60.0, -1.0, 0.5
    got = logprobs(row, 7, 3)
    assert list(got.top_ids) == [7, 500, 0]
    np.testing.assert_allclose(got.top_logprobs, reference(row)[[7, 500, 0]], atol=1e-5)
