"""Next-token choice of the batched edge engine (numpy only)."""

from __future__ import annotations

import numpy as np

from services.common.sampling import SamplingParams
from services.edge_worker.sampler import pick, rng_for

LOGITS = np.array([0.5, 3.0, 2.9, -1.0, 2.0, 0.0], dtype=np.float32)


def draws(sampling: SamplingParams, n: int = 200) -> list[int]:
    rng = rng_for(sampling)
    return [pick(LOGITS, sampling, rng) for _ in range(n)]


def test_greedy_is_the_argmax_without_a_generator() -> None:
    sampling = SamplingParams(max_tokens=1)
    assert rng_for(sampling) is None
    assert pick(LOGITS, sampling, None) == 1
    assert set(draws(SamplingParams(max_tokens=1, temperature=1.0, top_k=1))) == {1}


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    assert set(draws(SamplingParams(max_tokens=1, temperature=1.0, top_k=2, seed=1))) == {1, 2}
    assert set(draws(SamplingParams(max_tokens=1, temperature=1.0, top_p=0.01, seed=1))) == {1}
    wide = set(draws(SamplingParams(max_tokens=1, temperature=2.0, seed=1), n=2000))
    assert {0, 1, 2, 4, 5} <= wide


def test_a_seed_reproduces_its_draws() -> None:
    sampling = SamplingParams(max_tokens=1, temperature=1.0, seed=42)
    assert draws(sampling) == draws(sampling)
    assert draws(sampling) != draws(SamplingParams(max_tokens=1, temperature=1.0, seed=43))
