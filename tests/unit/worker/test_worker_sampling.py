from __future__ import annotations

from typing import Any

import pytest

from services.common.errors import InvalidArgument
from services.worker.sampling import resolve_sampling, validate_prompt
from services.worker.types import EngineInfo

INFO = EngineInfo("m", vocab_size=100, context_length=50, eos_token_ids=frozenset({0}))


def resolve(**kw: Any) -> Any:
    args: dict[str, Any] = dict(
        max_tokens=0, temperature=0.0, top_p=0.0, top_k=0, seed=None, stop=(), prompt_tokens=10, info=INFO
    )
    args.update(kw)
    return resolve_sampling(**args)


def test_defaults() -> None:
    s = resolve(default_max_tokens=20)
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.greedy) == (
        20,
        0.0,
        1.0,
        0,
        None,
        (),
        True,
    )


def test_default_max_tokens_is_clamped_to_the_context() -> None:
    assert resolve(prompt_tokens=45).max_tokens == 5


def test_explicit_values_are_kept() -> None:
    s = resolve(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=42, stop=["a", "a", "b"])
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.greedy) == (
        7,
        0.5,
        0.9,
        3,
        42,
        ("a", "b"),
        False,
    )


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_tokens": 41}, "lower max_tokens to at most 40"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": ["x"] * 9}, "stop strings"),
        ({"stop": [""]}, "stop string"),
    ],
)
def test_invalid_sampling(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        resolve(**kw)


@pytest.mark.parametrize(
    ("ids", "needle"), [([], "empty"), ([5, 100], "token id 100 is out of range"), (list(range(50)), "shorten")]
)
def test_invalid_prompt(ids: list[int], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        validate_prompt(ids, INFO)


def test_valid_prompt() -> None:
    validate_prompt([1, 99], INFO)
