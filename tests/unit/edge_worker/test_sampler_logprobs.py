"""The edge sampler's logprobs on hand-made logits: equal to a reference log-softmax (float64), top-k
most likely first with ties by id, of the penalised row the token was drawn from."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.sampling import SamplingParams
from services.edge_worker.sampler import logprobs, logprobs_rows, pick
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
    assert np.array_equal(row, np.random.default_rng(7).standard_normal(49152).astype(np.float32) * 4)  # untouched


def test_a_batch_of_rows_with_different_tops_equals_each_row_alone() -> None:
    rows = np.random.default_rng(1).standard_normal((4, 3000)).astype(np.float32) * 3
    tokens, tops = [5, 17, 2999, 0], [0, 3, 20, 1]
    together = logprobs_rows(rows.copy(), tokens, tops)
    for i in range(4):
        alone = logprobs(rows[i], tokens[i], tops[i])
        assert list(together[i].top_ids) == list(alone.top_ids) and len(alone.top_ids) == tops[i]
        assert together[i].logprob == pytest.approx(reference(rows[i])[tokens[i]], abs=1e-5)
        np.testing.assert_allclose(together[i].top_logprobs, alone.top_logprobs, atol=1e-6)


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
