"""``n`` in the one sampling type: bounds, the per-choice seed, the cache key, the pb conversion."""

from __future__ import annotations

import pytest

from services.common import sampling_pb
from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import MAX_CHOICES, MAX_SEED, SamplingParams, resolve_sampling


@pytest.mark.parametrize("n", [0, MAX_CHOICES + 1, -1])
def test_n_out_of_range_names_the_field_and_the_limit(n: int) -> None:
    with pytest.raises(InvalidArgument, match=r"sampling\.n must be between 1 and 16"):
        resolve_sampling(max_tokens=4, n=n)


def test_choice_i_samples_with_seed_plus_i_wrapping_at_2_64() -> None:
    params = resolve_sampling(max_tokens=4, temperature=1.0, seed=MAX_SEED - 1, n=3)
    assert [params.choice(i).seed for i in range(3)] == [MAX_SEED - 1, MAX_SEED, 0]
    assert all(params.choice(i).n == 1 for i in range(3))
    assert resolve_sampling(max_tokens=4, n=2).choice(1).seed is None  # unseeded choices draw fresh seeds


def test_n_is_in_the_cache_key_only_when_not_1() -> None:
    one = resolve_sampling(max_tokens=4).canonical()
    assert "n" not in one  # keys made before n existed still match
    assert resolve_sampling(max_tokens=4, n=2).canonical() == {**one, "n": 2}


def test_pb_unset_n_is_1_an_explicit_0_is_refused_and_n_round_trips() -> None:
    assert sampling_pb.from_pb(pb.SamplingParams()).n == 1
    with pytest.raises(InvalidArgument, match=r"sampling\.n"):
        sampling_pb.from_pb(pb.SamplingParams(n=0))
    msg = sampling_pb.to_pb(SamplingParams(max_tokens=3, n=4))
    assert msg.n == 4 and sampling_pb.from_pb(msg).n == 4
    assert not sampling_pb.to_pb(SamplingParams(max_tokens=3)).HasField("n")
