"""The cloud sampler under a structured-output constraint: the device mask per row, a sequence's mask,
and rows without a constraint left bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.sampling import SamplingParams
from services.gpu_worker.device_sampler import RowSampling, SamplingBuffers, sample_rows
from services.gpu_worker.sampler import Sampler

VOCAB = 100


class FakeConstraint:
    """A fixed allowed set (the grammar itself is tested in tests/unit/worker/test_grammar.py)."""

    def __init__(self, allowed: list[int]) -> None:
        row = np.zeros(128, dtype=bool)
        row[allowed] = True
        self._allowed = row[:VOCAB]
        self._bitmask = np.packbits(row, bitorder="little").view(np.int32)
        self.advanced: list[int] = []

    def bitmask(self) -> np.ndarray:
        return self._bitmask

    def allowed(self) -> np.ndarray:
        return self._allowed

    def advance(self, token: int) -> None:
        self.advanced.append(token)


def rows(n: int, sampled: bool = False) -> list[RowSampling]:
    sampling = SamplingParams(max_tokens=4, temperature=1.0 if sampled else 0.0, seed=7)
    return [RowSampling.from_config(sampling) for _ in range(n)]


@pytest.mark.parametrize("sampled", [False, True])
def test_constrained_rows_choose_allowed_tokens_and_others_are_untouched(sampled: bool) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    plain = sample_rows(logits, rows(3, sampled), [0, 0, 0])
    allowed = [5, 17, 63]
    mask = FakeConstraint(allowed).bitmask()
    got = sample_rows(logits, rows(3, sampled), [0, 0, 0], masks=[None, mask, None])
    assert got[1] in allowed
    assert got[0] == plain[0] and got[2] == plain[2]
    if not sampled:
        assert got[1] == allowed[int(torch.argmax(logits[1, allowed]))]


def test_the_static_buffers_skip_the_mask_when_no_row_is_constrained() -> None:
    buffers = SamplingBuffers(4, torch.device("cpu"))
    assert not buffers.fill_masks([None, None], VOCAB)
    assert buffers.fill_masks([None, FakeConstraint([9]).bitmask()], VOCAB)
    logits = torch.zeros(2, VOCAB)
    assert buffers.sample(logits, sampled=False, constrained=True).tolist() == [0, 9]


def test_a_sequences_mask_constrains_its_token_and_record_advances_the_grammar() -> None:
    constraint = FakeConstraint([3, 4])
    sampler = Sampler(SamplingParams(max_tokens=4), constraint=constraint)  # type: ignore[arg-type]
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 1.0
    logits[0, 50] = 9.0
    (token,) = sample_rows(logits, [sampler.row], [0], [sampler.penalties], masks=[sampler.mask()])
    assert token == 4
    sampler.record(token)
    assert constraint.advanced == [4]
    assert np.array_equal(sampler.mask(), constraint.bitmask())  # type: ignore[arg-type]
    assert Sampler(SamplingParams(max_tokens=4)).mask() is None


def test_the_noise_is_finite_so_a_masked_token_is_never_drawn() -> None:
    """Seed 1005, step 33, token 11570 hashes to the largest 24-bit draw, whose uniform value rounded to
    1.0 in float32 (noise +inf; -inf + inf = NaN, which argmax took: a token the mask had removed)."""
    from services.gpu_worker.device_sampler import gumbel_noise

    one = torch.tensor([1005]), torch.tensor([0]), torch.tensor([33])
    noise = gumbel_noise(*one, 49152)
    assert bool(torch.isfinite(noise).all())
    logits = torch.zeros(1, 49152)
    mask = np.zeros(49152 // 32, dtype=np.int32)
    mask.view(np.uint32)[0] = np.uint32(1 << 2)  # EOS (2) alone, as after a complete JSON value
    row = RowSampling.from_config(SamplingParams(max_tokens=4, temperature=0.2, top_p=0.9, seed=1005))
    assert sample_rows(logits, [row], [33], None, masks=[mask]) == [2]
