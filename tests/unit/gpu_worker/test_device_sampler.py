"""The on-device batch sampler: greedy rows, seeded determinism, top-k / top-p masks, padding rows."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.sampling import SamplingParams
from services.gpu_worker.device_sampler import PAD_ROW, RowSampling, SamplingBuffers, gumbel_noise, sample_rows
from services.gpu_worker.graphs import batch_buckets, width_buckets

VOCAB = 50


def row(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = 7) -> RowSampling:
    return RowSampling.from_config(
        SamplingParams(max_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    )


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_rows_take_the_argmax() -> None:
    x = logits(4)
    greedy = RowSampling.from_config(SamplingParams(max_tokens=1))
    assert greedy.greedy
    assert sample_rows(x, [greedy] * 4, [0, 1, 2, 3]) == x.argmax(-1).tolist()


def test_a_seed_reproduces_its_tokens_whatever_shares_the_batch() -> None:
    x = logits(1)
    alone = [sample_rows(x, [row(seed=42)], [step])[0] for step in range(40)]
    again = [sample_rows(x, [row(seed=42)], [step])[0] for step in range(40)]
    assert alone == again
    mixed = logits(5, seed=3)
    mixed[2] = x[0]
    rows = [row(seed=1), row(temperature=0.0), row(seed=42), row(seed=9, top_k=3), row(seed=5, top_p=0.5)]
    with_others = [sample_rows(mixed, rows, [s, 0, s, s + 1, 3])[2] for s in range(40)]
    assert with_others == alone
    assert len(set(alone)) > 3  # temperature 1 over a spread distribution: not always the argmax
    other_seed = [sample_rows(x, [row(seed=43)], [step])[0] for step in range(40)]
    assert other_seed != alone


def test_top_k_keeps_the_k_most_likely_tokens() -> None:
    x = logits(1, seed=5)
    top3 = set(x[0].topk(3).indices.tolist())
    picks = set(sample_rows(x.expand(200, -1), [row(temperature=5.0, top_k=3, seed=s) for s in range(200)], [0] * 200))
    assert picks == top3


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    picks = set(sample_rows(x.expand(300, -1), [row(top_p=0.7, seed=s) for s in range(300)], [0] * 300))
    assert picks == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    picks = {sample_rows(x, [row(top_p=0.01, seed=s)], [0])[0] for s in range(50)}
    assert picks == {0}  # the most likely token is always kept


def test_frequencies_follow_the_tempered_distribution() -> None:
    x = torch.log(torch.tensor([[0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3)]) + 1e-30)
    n = 3000
    picks = sample_rows(x.expand(n, -1), [row(seed=s) for s in range(n)], [s % 7 for s in range(n)])
    for token, p in ((0, 0.6), (1, 0.3), (2, 0.1)):
        share = picks.count(token) / n
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / n), (token, share)


def test_gumbel_noise_is_standard_gumbel() -> None:
    seeds = torch.arange(64, dtype=torch.int64)
    g = gumbel_noise(seeds, seeds * 3, seeds % 5, 4096)
    assert g.shape == (64, 4096) and torch.isfinite(g).all()
    assert abs(float(g.mean()) - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.05


def test_padding_rows_are_greedy_and_change_no_real_row() -> None:
    buffers = SamplingBuffers(8, torch.device("cpu"))
    rows = [row(seed=1), row(seed=2, top_k=5)]
    assert buffers.fill(rows, [3, 4]) is True
    assert buffers.greedy[2:].all() and not buffers.greedy[:2].any()
    x = logits(8, seed=11)
    padded = buffers.sample(x, sampled=True)
    assert padded[:2].tolist() == sample_rows(x[:2], rows, [3, 4])
    assert padded[2:].tolist() == x[2:].argmax(-1).tolist()
    assert buffers.fill([PAD_ROW], [0]) is False  # all greedy: the buffers are not even written
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill([PAD_ROW] * 9, [0] * 9)


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert width_buckets(3) == [3]
    assert width_buckets(512) == [8, 16, 32, 64, 128, 256, 512]
    assert width_buckets(100) == [8, 16, 32, 64, 100]
