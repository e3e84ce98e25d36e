"""The one sampling type: its validator (every branch), defaults, context fitting, greedy/deterministic
and the canonical form of the response-cache key; and its pb conversion at the service edges."""

from __future__ import annotations

import dataclasses
import math
import re
import struct
from typing import Any

import pytest

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.sampling import (
    DEFAULT_MAX_TOKENS,
    DEFAULTABLE,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MESH_LIMITS,
    SamplingLimits,
    SamplingParams,
    resolve_sampling,
)
from services.common.sampling_pb import from_pb, to_pb


def test_every_field_has_a_docstring() -> None:
    import inspect

    import services.common.sampling as module

    source = inspect.getsource(module.SamplingParams) + inspect.getsource(module.SamplingLimits)
    for cls in (SamplingParams, SamplingLimits):
        for f in dataclasses.fields(cls):
            line = next(ln for ln in source.splitlines() if ln.strip().startswith(f"{f.name}:"))
            after = source.split(line, 1)[1].lstrip()
            assert after.startswith('"""'), f"{cls.__name__}.{f.name} has no docstring"


def test_the_type_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams(max_tokens=1).max_tokens = 2  # type: ignore[misc]


# -- defaults ----------------------------------------------------------------------------------------


def test_defaults() -> None:
    s = resolve_sampling()
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.greedy) == (0, 0.0, 1.0, 0, None, (), True)
    assert s.fit(10, 50, default_max_tokens=20).max_tokens == 20
    assert resolve_sampling().fit(10, 10_000).max_tokens == DEFAULT_MAX_TOKENS


def test_explicit_values_are_kept_and_duplicate_stops_dropped() -> None:
    s = resolve_sampling(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=42, stop=["a", "a", "b"])
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.greedy) == (
        7,
        0.5,
        0.9,
        3,
        42,
        ("a", "b"),
        False,
    )


def test_the_limits_themselves_are_accepted() -> None:
    s = resolve_sampling(
        temperature=MAX_TEMPERATURE,
        top_p=1.0,
        top_k=MAX_TOP_K,
        seed=MAX_SEED,
        stop=["x" * MAX_STOP_CHARS] + [str(i) for i in range(MAX_STOP_STRINGS - 1)],
    )
    assert (s.temperature, s.top_k, s.seed, len(s.stop)) == (2.0, MAX_TOP_K, MAX_SEED, MAX_STOP_STRINGS)
    assert resolve_sampling(seed=0).seed == 0  # 0 is a seed, not "no seed"


# -- every validation branch -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_tokens": -1}, "sampling.max_tokens must be >= 0"),
        ({"temperature": 2.5}, "sampling.temperature must be between 0 and 2"),
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"top_p": 1.5}, "sampling.top_p must be between 0 and 1"),
        ({"top_p": -0.5}, "sampling.top_p"),
        ({"top_p": math.nan}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k must be between 0 and"),
        ({"top_k": MAX_TOP_K + 1}, "sampling.top_k"),
        ({"seed": -1}, "sampling.seed must be between 0 and"),
        ({"seed": MAX_SEED + 1}, "sampling.seed"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"9 stop strings; send at most {MAX_STOP_STRINGS}"),
        ({"stop": [""]}, "empty stop string"),
        ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, f"at most {MAX_STOP_CHARS} characters"),
    ],
)
def test_invalid_sampling_names_the_field_and_limit_in_one_sentence(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(needle)) as err:
        resolve_sampling(**kw)
    assert "\n" not in err.value.message and err.value.message.count(". ") == 0


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_tokens": 51}, "sampling.max_tokens is 51, above the limit of 50"),
        ({"stop": ["a", "b", "c"]}, "send at most 2"),
        ({"stop": ["toolong"]}, "at most 5 characters"),
    ],
)
def test_tighter_limits(kw: dict[str, Any], needle: str) -> None:
    limits = SamplingLimits(max_tokens=50, max_stop_strings=2, max_stop_chars=5)
    with pytest.raises(InvalidArgument, match=re.escape(needle)):
        resolve_sampling(limits=limits, **kw)
    resolve_sampling(max_tokens=50, stop=["ab", "cdefg"], limits=limits)
    resolve_sampling(max_tokens=10**6)  # the mesh's own limits leave max_tokens to the context


# -- fitting to the context --------------------------------------------------------------------------


def test_default_max_tokens_is_clamped_to_the_context() -> None:
    assert resolve_sampling().fit(45, 50, default_max_tokens=20).max_tokens == 5
    assert resolve_sampling().fit(49, 50).max_tokens == 1


def test_explicit_max_tokens_that_fits_is_kept() -> None:
    s = resolve_sampling(max_tokens=40, temperature=0.5)
    assert s.fit(10, 50) is s


def test_explicit_max_tokens_beyond_the_context_is_an_error() -> None:
    with pytest.raises(InvalidArgument, match="lower max_tokens to at most 40") as err:
        resolve_sampling(max_tokens=41).fit(10, 50)
    assert "\n" not in err.value.message


@pytest.mark.parametrize("prompt_tokens", [50, 60])
def test_a_prompt_that_fills_the_context_is_an_error(prompt_tokens: int) -> None:
    for s in (resolve_sampling(), resolve_sampling(max_tokens=1)):
        with pytest.raises(InvalidArgument, match="shorten it"):
            s.fit(prompt_tokens, 50)


# -- greedy, deterministic ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "greedy", "deterministic"),
    [
        ({}, True, True),
        ({"temperature": 0.8}, False, False),
        ({"temperature": 0.8, "seed": 0}, False, True),
        ({"temperature": 0.8, "top_k": 1}, True, True),  # one candidate: argmax, whatever the temperature
        ({"temperature": 0.8, "top_k": 2}, False, False),
        ({"temperature": 0.0, "top_k": 5, "top_p": 0.3}, True, True),
    ],
)
def test_greedy_and_deterministic(kw: dict[str, Any], greedy: bool, deterministic: bool) -> None:
    s = SamplingParams(max_tokens=1, **kw)
    assert (s.greedy, s.deterministic) == (greedy, deterministic)


# -- canonical form (response-cache keys) ------------------------------------------------------------


def test_greedy_ignores_sampling_knobs() -> None:
    base = SamplingParams(max_tokens=16)
    assert base.canonical() == SamplingParams(max_tokens=16, top_p=0.5, top_k=7, seed=3).canonical()
    assert base.canonical() == {"max_tokens": 16, "stop": [], "temperature": 0}


def test_top_k_1_is_greedy_in_the_canonical_form_too() -> None:
    greedy = SamplingParams(max_tokens=16).canonical()
    assert SamplingParams(max_tokens=16, temperature=0.9, top_k=1, top_p=0.5, seed=3).canonical() == greedy


def test_canonical_floats_stop_order_and_defaults() -> None:
    f32 = struct.unpack("<f", struct.pack("<f", 0.7))[0]  # what a proto float field delivers
    a = SamplingParams(max_tokens=8, temperature=f32, top_p=0.0, seed=5, stop=("b", "a", "a"))
    b = SamplingParams(max_tokens=8, temperature=0.7, top_p=1.0, seed=5, stop=("a", "b"))
    assert a.canonical() == b.canonical()
    assert a.canonical() == {
        "max_tokens": 8,
        "stop": ["a", "b"],
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 0,
        "seed": 5,
    }
    assert (
        SamplingParams(max_tokens=8, temperature=0.7, seed=5).canonical()
        != SamplingParams(max_tokens=8, temperature=0.7, seed=6).canonical()
    )
    assert SamplingParams(max_tokens=8).canonical() != SamplingParams(max_tokens=9).canonical()


def test_canonical_refuses_a_non_finite_float() -> None:
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(max_tokens=1, temperature=math.inf).canonical()


def test_deterministic() -> None:
    assert SamplingParams(max_tokens=1).deterministic
    assert SamplingParams(max_tokens=1, temperature=0.8, seed=0).deterministic
    assert not SamplingParams(max_tokens=1, temperature=0.8).deterministic


# -- pb at the edges ---------------------------------------------------------------------------------


def test_from_pb_applies_neutral_values_names_the_unset_fields_and_checks() -> None:
    s = from_pb(inference_pb2.SamplingParams())
    assert s == SamplingParams(max_tokens=0, defaulted=frozenset(DEFAULTABLE)) and s.seed is None
    msg = inference_pb2.SamplingParams(max_tokens=5, temperature=0.5, top_p=0.25, top_k=3, seed=0, stop=["x", "x"])
    assert from_pb(msg) == SamplingParams(
        max_tokens=5,
        temperature=0.5,
        top_p=0.25,
        top_k=3,
        seed=0,
        stop=("x",),
        defaulted=frozenset({"repetition_penalty"}),
    )
    # An explicit 0 is set, not unset: it wins over any model default.
    zero = from_pb(inference_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=0.0))
    assert not {"temperature", "top_k", "top_p"} & zero.defaulted and zero.top_p == 1.0
    with pytest.raises(InvalidArgument, match=r"sampling\.temperature"):
        from_pb(inference_pb2.SamplingParams(temperature=3.0))
    with pytest.raises(InvalidArgument, match="above the limit of 4"):
        from_pb(inference_pb2.SamplingParams(max_tokens=5), SamplingLimits(max_tokens=4))
    assert MESH_LIMITS.max_tokens is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=3),
        SamplingParams(max_tokens=9, temperature=0.5, top_p=0.25, top_k=40, seed=MAX_SEED, stop=("a", "\n")),
        SamplingParams(max_tokens=1, temperature=1.0, seed=0),
    ],
)
def test_to_pb_round_trips(params: SamplingParams) -> None:
    msg = to_pb(params)
    assert msg.HasField("seed") == (params.seed is not None)
    assert all(msg.HasField(f) for f in ("temperature", "top_p", "top_k", "repetition_penalty"))
    back = from_pb(msg)
    # No stop strings on the wire reads as "the model's default stop strings" (the proto's unset).
    assert back.defaulted == (frozenset() if params.stop else frozenset({"stop"}))
    assert dataclasses.replace(back, defaulted=frozenset()) == params


def test_to_pb_leaves_the_unset_fields_unset_for_a_router_in_another_process() -> None:
    request = from_pb(inference_pb2.SamplingParams(max_tokens=4, top_k=7))
    msg = to_pb(request)
    assert msg.HasField("top_k") and not any(msg.HasField(f) for f in ("temperature", "top_p", "repetition_penalty"))
    assert from_pb(msg) == request
