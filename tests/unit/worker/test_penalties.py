"""One sequence's penalties (services/worker/penalties.py) on hand-made logits: each rule's arithmetic,
what counts (prompt for repetition, output only for frequency/presence), and min_tokens on EOS."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.sampling import SamplingParams
from services.worker.penalties import Penalties, penalties_for

EOS = 9


def make(prompt: list[int] = (), **kw: object) -> Penalties:  # type: ignore[assignment]
    p = penalties_for(SamplingParams(max_tokens=16, **kw), prompt, {EOS})  # type: ignore[arg-type]
    assert p is not None
    return p


def test_no_penalties_means_none() -> None:
    assert penalties_for(SamplingParams(max_tokens=4), [1, 2], {EOS}) is None


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output() -> None:
    p = make([1, 2], repetition_penalty=2.0)
    logits = np.array([4.0, 4.0, -4.0, 4.0, 0, 0, 0, 0, 0, 0], dtype=np.float32)
    out = p.apply(logits)
    assert out[0] == 4.0 and out[1] == 2.0 and out[2] == -8.0 and out[3] == 4.0
    p.record(3)
    assert p.apply(logits)[3] == 2.0
    assert logits[1] == 4.0  # the input is left alone


def test_frequency_and_presence_count_generated_tokens_only() -> None:
    p = make([1], frequency_penalty=0.5, presence_penalty=1.0)
    logits = np.zeros(10, dtype=np.float32)
    assert p.apply(logits)[1] == 0.0  # a prompt token is not penalised
    for t in (2, 2, 2, 3):
        p.record(t)
    out = p.apply(logits)
    assert out[2] == pytest.approx(-(0.5 * 3 + 1.0)) and out[3] == pytest.approx(-1.5) and out[1] == 0.0


def test_logit_bias_is_added_before_the_repetition_scaling() -> None:
    p = make([5], logit_bias=((5, 4.0), (6, -100.0)), repetition_penalty=2.0)
    out = p.apply(np.zeros(10, dtype=np.float32))
    assert out[5] == 2.0 and out[6] == -100.0


def test_min_tokens_bans_eos_until_reached() -> None:
    p = make(min_tokens=2)
    logits = np.zeros(10, dtype=np.float32)
    logits[EOS] = 50.0
    assert np.isneginf(p.apply(logits)[EOS])
    p.record(1)
    assert np.isneginf(p.apply(logits)[EOS])
    p.record(1)
    assert p.apply(logits)[EOS] == 50.0


def test_state_grows_past_its_first_capacity() -> None:
    p = make(list(range(100)), repetition_penalty=1.5, frequency_penalty=0.1)
    for t in range(100, 300):
        p.record(t)
    assert p.seen_ids.size == 300 and p.generated == 200
    assert p.apply(np.ones(400, dtype=np.float32))[299] == pytest.approx(1 / 1.5 - 0.1)


def test_in_place_adjusts_the_callers_row_and_copy_leaves_it() -> None:
    p = make(logit_bias=((2, 1.0),))
    row = np.zeros(4, dtype=np.float32)
    assert p.apply(row)[2] == 1.0 and row[2] == 0.0
    assert p.apply(row, in_place=True) is row and row[2] == 1.0
    wide = np.zeros(4, dtype=np.float64)  # not float32: copied whatever in_place says
    assert p.apply(wide, in_place=True) is not wide and wide[2] == 0.0


def test_under_a_constraint_the_repetition_penalty_counts_the_generated_tokens_only() -> None:
    """A constrained text must copy the prompt's words (a JSON value, a tool argument): the prompt is not
    penalised; what the turn itself generated still is, and frequency/presence are as always."""
    from services.common.constraints import check_constraint

    json_mode = check_constraint("json_object")
    p = make([1, 2], repetition_penalty=2.0, frequency_penalty=0.5, structured=json_mode)
    logits = np.array([4.0, 4.0, -4.0, 4.0, 0, 0, 0, 0, 0, 0], dtype=np.float32)
    out = p.apply(logits)
    assert out[1] == 4.0 and out[2] == -4.0  # prompt tokens untouched
    assert list(p.seen_ids) == []
    p.record(3)
    assert p.apply(logits)[3] == 4.0 / 2.0 - 0.5  # a generated token: divided, then its frequency
    plain = make([1, 2], repetition_penalty=2.0)
    assert plain.apply(logits)[1] == 2.0  # the same penalty without a constraint counts the prompt
