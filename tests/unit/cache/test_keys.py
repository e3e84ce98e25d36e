from __future__ import annotations

from typing import Any

import pytest

from services.cache.keys import RESPONSE_PREFIX, SamplingSpec, response_key, response_pattern


def key(**over: Any) -> str:
    args: dict[str, Any] = dict(
        model_id="m",
        model_version="v1",
        tokenizer_id="tok",
        sampling=SamplingSpec(max_tokens=16),
        prompt_ids=[1, 2, 3],
        tenant="acme",
        shareable=False,
    )
    args.update(over)
    return response_key(**args)


def test_namespaced_and_stable() -> None:
    k = key()
    assert k.startswith(f"{RESPONSE_PREFIX}:m:") and k.startswith("meshserve:v1:resp:")
    assert k == key()
    assert len(k.rsplit(":", 1)[1]) == 64
    assert response_pattern("m") == "meshserve:v1:resp:m:*"


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"model_version": "v2"},
        {"tokenizer_id": "tok2"},
        {"prompt_ids": [1, 2, 4]},
        {"prompt_ids": [1, 2, 3, 0]},
        {"sampling": SamplingSpec(max_tokens=17)},
        {"sampling": SamplingSpec(max_tokens=16, stop=("x",))},
        {"sampling": SamplingSpec(max_tokens=16, temperature=0.5, seed=1)},
    ],
)
def test_every_input_changes_the_key(change: dict[str, Any]) -> None:
    assert key(**change) != key()


def test_tenant_salt_unless_shareable() -> None:
    assert key(tenant="a") != key(tenant="b")
    assert key(tenant="a", shareable=True) == key(tenant="b", shareable=True)
    assert key(tenant="a", shareable=True) != key(tenant="a")


def test_no_field_boundary_collisions() -> None:
    assert key(model_id="ab", model_version="c") != key(model_id="a", model_version="bc")


def test_greedy_ignores_sampling_knobs() -> None:
    base = SamplingSpec(max_tokens=16)
    assert base.canonical() == SamplingSpec(max_tokens=16, top_p=0.5, top_k=7, seed=3).canonical()


def test_canonical_floats_stop_order_and_defaults() -> None:
    import struct

    f32 = struct.unpack("<f", struct.pack("<f", 0.7))[0]  # what a proto float field delivers
    a = SamplingSpec(max_tokens=8, temperature=f32, top_p=0.0, seed=5, stop=("b", "a", "a"))
    b = SamplingSpec(max_tokens=8, temperature=0.7, top_p=1.0, seed=5, stop=("a", "b"))
    assert a.canonical() == b.canonical()
    assert (
        SamplingSpec(max_tokens=8, temperature=0.7, seed=5).canonical()
        != SamplingSpec(max_tokens=8, temperature=0.7, seed=6).canonical()
    )


def test_deterministic() -> None:
    assert SamplingSpec(max_tokens=1).deterministic
    assert SamplingSpec(max_tokens=1, temperature=0.8, seed=0).deterministic
    assert not SamplingSpec(max_tokens=1, temperature=0.8).deterministic
