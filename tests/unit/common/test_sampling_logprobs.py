"""``logprobs`` / ``top_logprobs`` in the one sampling type: bounds with messages naming the field, the
wire round trip, and the response-cache key (unchanged without them, different with them)."""

from __future__ import annotations

import pytest

from services.common import sampling_pb
from services.common.errors import InvalidArgument
from services.common.sampling import MAX_TOP_LOGPROBS, resolve_sampling


def test_bounds_name_the_field() -> None:
    assert resolve_sampling(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS).top_logprobs == 20
    with pytest.raises(InvalidArgument, match=r"sampling\.top_logprobs must be between 0 and 20"):
        resolve_sampling(logprobs=True, top_logprobs=21)
    with pytest.raises(InvalidArgument, match=r"sampling\.top_logprobs needs sampling\.logprobs"):
        resolve_sampling(top_logprobs=2)


def test_wire_round_trip_and_cache_key() -> None:
    params = resolve_sampling(max_tokens=4, logprobs=True, top_logprobs=3)
    assert sampling_pb.from_pb(sampling_pb.to_pb(params)) == params
    plain = resolve_sampling(max_tokens=4)
    assert "logprobs" not in plain.canonical()  # keys made before the field existed still match
    assert params.canonical() != plain.canonical()
    assert params.canonical() != resolve_sampling(max_tokens=4, logprobs=True).canonical()
