"""The cloud tier's sampler with penalties on hand-made logits: the batch sampler (device_sampler.py, every
token of the cloud engine) over a sequence's sampling state (sampler.py) moves the argmax as expected,
bans and forces with logit_bias, keeps EOS out before min_tokens, and one row's penalties never change
another row's token."""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams
from services.gpu_worker.device_sampler import RowSampling, SamplingBuffers, sample_rows
from services.gpu_worker.sampler import Sampler
from services.worker.penalties import Penalties

EOS = 0
LOGITS = torch.tensor([[1.0, 5.0, 4.9, 4.0, 0.0, 0.0]])


def sampler(prompt: list[int], generated: list[int], **kw: object) -> Sampler:
    s = Sampler(SamplingParams(max_tokens=16, **kw), prompt, {EOS})  # type: ignore[arg-type]
    for t in generated:
        s.record(t)
    return s


def pick(prompt: list[int], generated: list[int], logits: torch.Tensor = LOGITS, **kw: object) -> int:
    """The token the cloud engine chooses for a sequence with this history."""
    s = sampler(prompt, generated, **kw)
    return sample_rows(logits, [s.row], [len(generated)], [s.penalties])[0]


def test_penalties_move_the_argmax() -> None:
    assert pick([1], []) == 1
    assert pick([1], [], repetition_penalty=1.1) == 2
    assert pick([1], [], frequency_penalty=2.0) == 1  # the prompt does not count for frequency
    assert pick([], [1], frequency_penalty=0.2) == 2
    assert pick([], [1], presence_penalty=0.2) == 2


def test_logit_bias_bans_and_forces() -> None:
    assert pick([], [], logit_bias=((1, -100.0),)) == 2
    assert pick([], [], logit_bias=((5, 100.0),)) == 5
    for seed in range(10):
        assert pick([], [], logit_bias=((4, 100.0),), temperature=1.0, seed=seed) == 4
        assert pick([], [], logit_bias=((1, -100.0), (2, -100.0)), temperature=0.5, seed=seed) not in (1, 2)


def test_min_tokens_suppresses_eos() -> None:
    eos_first = torch.tensor([[9.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    assert pick([], [], eos_first) == EOS
    assert pick([], [], eos_first, min_tokens=2) == 1
    assert pick([], [3], eos_first, min_tokens=2) == 1
    assert pick([], [3, 3], eos_first, min_tokens=2) == EOS


def test_a_rows_penalties_never_change_another_rows_token() -> None:
    vocab = 64
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    plain = [RowSampling.from_config(SamplingParams(max_tokens=4, temperature=t, seed=5)) for t in (0, 0.8, 0, 1)]
    alone = sample_rows(x, plain, [3, 3, 3, 3])
    heavy = Sampler(
        SamplingParams(max_tokens=4, repetition_penalty=2.0, logit_bias=((int(x[1].argmax()), -100.0),), min_tokens=3),
        list(range(vocab)),
        {EOS},
    )
    mixed = sample_rows(x, [*plain[:1], heavy.row, *plain[2:]], [3, 3, 3, 3], [None, heavy.penalties, None, None])
    assert mixed[0] == alone[0] and mixed[2:] == alone[2:]
    assert mixed[1] != int(x[1].argmax())


def test_static_buffers_reset_between_steps() -> None:
    """The static step's buffers: a row penalised in one step and not in the next is neutral again."""
    x = torch.tensor([[1.0, 5.0, 4.9, 4.0], [1.0, 5.0, 4.9, 4.0]])
    greedy = RowSampling.from_config(SamplingParams(max_tokens=4))
    buffers = SamplingBuffers(4, x.device)
    p = Penalties(SamplingParams(max_tokens=4, logit_bias=((1, -100.0),)), [], {EOS})
    assert buffers.fill_penalties([p, None], 4)
    assert buffers.sample(x, sampled=False, penalized=True).tolist() == [2, 1]
    assert buffers.fill_penalties([None, p], 4)
    assert buffers.sample(x, sampled=False, penalized=True).tolist() == [1, 2]
    assert not buffers.fill_penalties([None, None], 4)
    assert buffers.fill([greedy, greedy], [0, 0]) is False


def test_greedy_with_penalties_is_deterministic() -> None:
    x = torch.randn(1, 500, generator=torch.Generator().manual_seed(0))
    picks = {pick([1, 2, 3], [4, 5, 4], x, repetition_penalty=1.3, frequency_penalty=0.5) for _ in range(4)}
    assert len(picks) == 1
