"""Input checks of the cloud engine's embeddings."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.gpu_worker import embed

LIMITS = dict(vocab=100, context=8, hidden=16)


@pytest.mark.parametrize(
    ("inputs", "dimensions", "message"),
    [
        ([], 0, r"inputs is empty"),
        ([[1], []], 0, r"inputs\[1\] has no tokens"),
        ([[100]], 0, r"inputs\[0\] holds token id 100, outside the vocabulary of 100"),
        ([[1] * 9], 0, r"inputs\[0\] is 9 tokens, above the model's context of 8"),
        ([[1]], 17, r"dimensions is 17, above the model's 16"),
    ],
)
def test_bad_inputs_are_refused_naming_the_input(inputs: list[list[int]], dimensions: int, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        embed.check_inputs(inputs, dimensions=dimensions, **LIMITS)  # type: ignore[arg-type]


def test_good_inputs_pass() -> None:
    embed.check_inputs([[1, 2], [99] * 8], dimensions=16, **LIMITS)  # type: ignore[arg-type]
