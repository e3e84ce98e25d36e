from __future__ import annotations

import pytest

from services.common.errors import Unavailable
from services.router.policy import RoundRobin, TierChoice, TierName, choose_tier

E, C = TierName.EDGE, TierName.CLOUD
BOTH = {E, C}


@pytest.mark.parametrize(
    ("tokens", "hint", "healthy", "expected"),
    [
        (10, None, BOTH, TierChoice(E, "prompt_short")),
        (128, None, BOTH, TierChoice(E, "prompt_short")),
        (129, None, BOTH, TierChoice(C, "prompt_long")),
        (10, C, BOTH, TierChoice(C, "hint")),
        (5000, E, BOTH, TierChoice(E, "hint")),
        (10, None, {C}, TierChoice(C, "spill")),
        (5000, None, {E}, TierChoice(E, "spill")),
        (10, E, {C}, TierChoice(C, "fallback")),
        (5000, C, {E}, TierChoice(E, "fallback")),
    ],
)
def test_choose_tier(tokens: int, hint: TierName | None, healthy: set[TierName], expected: TierChoice) -> None:
    assert choose_tier(tokens, hint, healthy, edge_max_prompt_tokens=128) == expected


def test_nothing_healthy() -> None:
    with pytest.raises(Unavailable):
        choose_tier(1, None, set(), 128)


def test_round_robin_per_group_and_exclude() -> None:
    rr = RoundRobin()
    assert [rr.pick("edge", ["a", "b", "c"]) for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.pick("cloud", ["x", "y"]) == "x"
    assert rr.pick("cloud", ["x", "y"], exclude=["y"]) == "x"
    assert rr.pick("cloud", ["x"], exclude=["x"]) is None
