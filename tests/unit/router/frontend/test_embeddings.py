"""Token bounds of Embed requests on the router."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.router.frontend.embeddings import check_tokens


def test_total_tokens_within_bounds() -> None:
    assert check_tokens([[1, 2], [3]], context_length=4, vocab_size=10, max_total=3) == 3


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([[1], []], r"input\[1\] has no tokens"),
        ([[1] * 5], r"input\[0\] is 5 tokens, above the model's context length of 4"),
        ([[1], [10]], r"input\[1\] holds token id 10, outside the model's vocabulary of 10"),
        ([[1, 2, 3], [1, 2]], r"5 tokens together, above the limit of 4"),
    ],
)
def test_out_of_bounds_is_refused_naming_the_input(inputs: list[list[int]], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        check_tokens(inputs, context_length=4, vocab_size=10, max_total=4)
