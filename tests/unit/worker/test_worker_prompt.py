"""The worker's prompt check (the sampling checks are tests/unit/common/test_sampling.py)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.worker.types import EngineInfo, validate_prompt

INFO = EngineInfo("m", vocab_size=100, context_length=50, eos_token_ids=frozenset({0}))


@pytest.mark.parametrize(
    ("ids", "needle"), [([], "empty"), ([5, 100], "token id 100 is out of range"), (list(range(50)), "shorten")]
)
def test_invalid_prompt(ids: list[int], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        validate_prompt(ids, INFO)


def test_valid_prompt() -> None:
    validate_prompt([1, 99], INFO)
