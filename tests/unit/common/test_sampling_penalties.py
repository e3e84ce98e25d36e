"""Penalties, ``logit_bias`` and ``min_tokens`` in the one sampling type: every bound (a message naming
the field), an unset repetition penalty left to the model, context/vocabulary fitting, the cache key and
the pb round trip."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.sampling import (
    MAX_ABS_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REPETITION_PENALTY,
    SamplingLimits,
    SamplingParams,
    resolve_sampling,
)
from services.common.sampling_pb import from_pb, to_pb
from services.store.keys import response_key


def test_defaults_are_neutral() -> None:
    s = resolve_sampling()
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.0, 0.0, 1.0)
    assert s.logit_bias == () and s.min_tokens == 0 and not s.penalized


def test_the_limits_themselves_are_accepted() -> None:
    s = resolve_sampling(
        frequency_penalty=-MAX_ABS_PENALTY,
        presence_penalty=MAX_ABS_PENALTY,
        repetition_penalty=MAX_REPETITION_PENALTY,
        logit_bias={i: (MAX_LOGIT_BIAS if i % 2 else -MAX_LOGIT_BIAS) for i in range(MAX_LOGIT_BIAS_ENTRIES)},
        min_tokens=10,
        max_tokens=10,
    )
    assert s.penalized and len(s.logit_bias) == MAX_LOGIT_BIAS_ENTRIES
    assert resolve_sampling(repetition_penalty=0.01).repetition_penalty == 0.01


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"frequency_penalty": 2.01}, "sampling.frequency_penalty must be between -2 and 2"),
        ({"frequency_penalty": -2.01}, "sampling.frequency_penalty must be between -2 and 2"),
        ({"frequency_penalty": float("nan")}, "sampling.frequency_penalty"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty must be between -2 and 2"),
        ({"presence_penalty": float("-inf")}, "sampling.presence_penalty"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty must be above 0 and at most 2"),
        ({"repetition_penalty": -1.0}, "sampling.repetition_penalty must be above 0"),
        ({"repetition_penalty": 2.01}, "sampling.repetition_penalty must be above 0 and at most 2"),
        ({"repetition_penalty": float("inf")}, "sampling.repetition_penalty"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "sampling.logit_bias has 301 entries; send at most 300"),
        ({"logit_bias": {5: 100.5}}, "sampling.logit_bias for token 5 is 100.5; biases must be between -100 and 100"),
        ({"logit_bias": {5: -101}}, "sampling.logit_bias for token 5"),
        ({"logit_bias": {5: float("nan")}}, "sampling.logit_bias for token 5"),
        ({"logit_bias": {-1: 1.0}}, "sampling.logit_bias names token id -1"),
        ({"logit_bias": {2**31: 1.0}}, "sampling.logit_bias names token id"),
        ({"min_tokens": -1}, "sampling.min_tokens must be >= 0"),
        ({"min_tokens": 11, "max_tokens": 10}, r"sampling.min_tokens \(11\) is above sampling.max_tokens \(10\)"),
    ],
)
def test_invalid_values_name_the_field_and_limit(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle) as info:
        resolve_sampling(**kw)
    assert info.value.message.count(". ") == 0  # one sentence


def test_min_tokens_respects_the_operators_max_tokens() -> None:
    with pytest.raises(InvalidArgument, match=r"sampling\.min_tokens is 5000, above the limit of 4096"):
        resolve_sampling(min_tokens=5000, limits=SamplingLimits(max_tokens=4096))


def test_an_unset_repetition_penalty_is_neutral_and_left_to_the_model_and_an_explicit_one_is_kept() -> None:
    unset = from_pb(inference_pb2.SamplingParams())
    assert unset.repetition_penalty == 1.0 and "repetition_penalty" in unset.defaulted
    explicit = from_pb(inference_pb2.SamplingParams(repetition_penalty=1.0))
    assert explicit.repetition_penalty == 1.0 and "repetition_penalty" not in explicit.defaulted
    # Unset stays unset on the wire (a router elsewhere applies the model's default), set stays set.
    assert not to_pb(unset).HasField("repetition_penalty")
    assert to_pb(explicit).HasField("repetition_penalty")


def test_fit_checks_the_vocabulary_and_raises_a_default_max_tokens_to_min_tokens() -> None:
    s = resolve_sampling(logit_bias={49151: -100})
    assert s.fit(10, 2048, vocab_size=49152).logit_bias == ((49151, -100.0),)
    with pytest.raises(InvalidArgument, match="token id 49152, outside the model's vocabulary of 49152 tokens"):
        resolve_sampling(logit_bias={49152: 1}).fit(10, 2048, vocab_size=49152)
    assert resolve_sampling(min_tokens=300).fit(10, 2048).max_tokens == 300
    with pytest.raises(InvalidArgument, match="min_tokens \\(300\\) exceeds the model context"):
        resolve_sampling(min_tokens=300).fit(1900, 2048)


def test_logit_bias_is_sorted_and_zero_biases_dropped() -> None:
    s = resolve_sampling(logit_bias={9: 1.0, 3: -2.0, 5: 0.0})
    assert s.logit_bias == ((3, -2.0), (9, 1.0))


def test_each_field_changes_the_canonical_form_even_when_greedy() -> None:
    base = SamplingParams(max_tokens=8)
    variants = [
        SamplingParams(max_tokens=8, frequency_penalty=0.5),
        SamplingParams(max_tokens=8, presence_penalty=0.5),
        SamplingParams(max_tokens=8, repetition_penalty=1.1),
        SamplingParams(max_tokens=8, logit_bias=((3, 5.0),)),
        SamplingParams(max_tokens=8, min_tokens=4),
    ]
    forms = [base.canonical()] + [v.canonical() for v in variants]
    assert len({repr(f) for f in forms}) == len(forms)
    assert "frequency_penalty" not in base.canonical()  # neutral values leave existing keys unchanged
    # proto float32 values give the same form as the float64 they came from
    direct = SamplingParams(max_tokens=8, frequency_penalty=0.7, repetition_penalty=1.15)
    assert from_pb(to_pb(direct)).canonical() == direct.canonical()


def test_penalties_change_the_response_cache_key() -> None:
    def key(s: SamplingParams) -> str:
        return response_key(
            model_id="m", model_version="v", tier="edge", tokenizer_id="t", sampling=s, prompt_ids=[1, 2], tenant="a"
        )

    seen = {key(SamplingParams(max_tokens=8))}
    for s in (
        SamplingParams(max_tokens=8, frequency_penalty=0.5),
        SamplingParams(max_tokens=8, presence_penalty=0.5),
        SamplingParams(max_tokens=8, repetition_penalty=1.15),
        SamplingParams(max_tokens=8, logit_bias=((3, -100.0),)),
        SamplingParams(max_tokens=8, min_tokens=2),
    ):
        assert key(s) not in seen
        seen.add(key(s))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, frequency_penalty=0.5, presence_penalty=-1.5),
        SamplingParams(max_tokens=8, repetition_penalty=1.5, logit_bias=((0, -100.0), (7, 2.5)), min_tokens=3),
    ],
)
def test_to_pb_round_trips(params: SamplingParams) -> None:
    assert replace(from_pb(to_pb(params)), defaulted=frozenset()) == params


def test_proto_fields_use_numbers_20_to_29_and_are_documented() -> None:
    fields = inference_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens"):
        assert 20 <= fields[name].number <= 29
    proto = (Path(__file__).parents[3] / "protos/meshserve/v1/inference.proto").read_text()
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens"):
        line = next(ln for ln in proto.splitlines() if re.search(rf"\b{name} = \d+;", ln))
        before = proto.split(line, 1)[0].rstrip().splitlines()[-1]
        assert before.strip().startswith("//"), name
