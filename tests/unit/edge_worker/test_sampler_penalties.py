"""The edge sampler with penalties on hand-made logits: each penalty moves the argmax as expected,
logit_bias -100 bans and +100 forces a token, min_tokens keeps EOS out, greedy stays deterministic."""

from __future__ import annotations

import numpy as np

from services.common.sampling import SamplingParams
from services.edge_worker.sampler import pick, rng_for
from services.worker.penalties import penalties_for

EOS = 0
LOGITS = np.array([1.0, 5.0, 4.9, 4.0, 0.0, 0.0], dtype=np.float32)  # argmax 1, runner-up 2


def choose(prompt: list[int], generated: list[int], logits: np.ndarray = LOGITS, **kw: object) -> int:
    sampling = SamplingParams(max_tokens=16, **kw)  # type: ignore[arg-type]
    penalties = penalties_for(sampling, prompt, {EOS})
    if penalties is not None:
        for t in generated:
            penalties.record(t)
    return pick(logits.copy(), sampling, rng_for(sampling), penalties)  # pick adjusts the row in place


def test_without_penalties_the_argmax_wins() -> None:
    assert choose([1], [1]) == 1


def test_repetition_penalty_over_the_prompt_moves_the_argmax() -> None:
    assert choose([1], [], repetition_penalty=1.1) == 2
    assert choose([4], [], repetition_penalty=1.1) == 1


def test_frequency_and_presence_penalties_over_the_output_move_the_argmax() -> None:
    assert choose([1], [], frequency_penalty=2.0) == 1  # the prompt does not count
    assert choose([], [1], frequency_penalty=0.2) == 2
    assert choose([], [1], presence_penalty=0.2) == 2
    assert choose([], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], frequency_penalty=0.05) == 2  # 10 * 0.05 > 0.1


def test_logit_bias_bans_and_forces() -> None:
    assert choose([], [], logit_bias=((1, -100.0),)) == 2
    assert choose([], [], logit_bias=((5, 100.0),)) == 5
    sampled = {"temperature": 1.0, "seed": 3}
    assert {choose([], [], logit_bias=((1, -100.0), (2, -100.0), (3, -100.0)), **sampled) for _ in range(20)} <= {
        0,
        4,
        5,
    }
    assert {choose([], [], logit_bias=((4, 100.0),), **sampled) for _ in range(20)} == {4}


def test_min_tokens_suppresses_eos() -> None:
    eos_first = np.array([9.0, 1.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)
    assert choose([], [], eos_first) == EOS
    assert choose([], [], eos_first, min_tokens=2) == 1
    assert choose([], [7], eos_first, min_tokens=2) == 1
    assert choose([], [7, 7], eos_first, min_tokens=2) == EOS


def test_greedy_with_penalties_is_deterministic() -> None:
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    runs = {choose([3, 4, 5], [7, 8, 7], logits, repetition_penalty=1.3, frequency_penalty=0.4) for _ in range(5)}
    assert len(runs) == 1
