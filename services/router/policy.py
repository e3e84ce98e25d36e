"""Routing policy: which tier, which replica. Pure functions and state, no grpc, no I/O.

Tier choice, in order:
1. an explicit hint (edge/cloud) is honoured when that tier has a healthy replica (reason "hint"),
   otherwise the other tier serves (reason "fallback");
2. prompts of at most ``edge_max_prompt_tokens`` go to the edge ("prompt_short"), longer ones to
   the cloud ("prompt_long"); when that tier has no healthy replica the other one serves ("spill").
Replica choice is round-robin over the healthy replicas of the chosen tier.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from services.common.errors import Unavailable


class TierName(StrEnum):
    EDGE = "edge"
    CLOUD = "cloud"

    @property
    def other(self) -> TierName:
        return TierName.CLOUD if self is TierName.EDGE else TierName.EDGE


@dataclass(frozen=True)
class TierChoice:
    """The chosen tier and a short machine-readable reason (RouteInfo.reason, metric label)."""

    tier: TierName
    reason: str


def choose_tier(
    prompt_tokens: int,
    hint: TierName | None,
    healthy: Collection[TierName],
    edge_max_prompt_tokens: int,
) -> TierChoice:
    """Pick the tier for a prompt of ``prompt_tokens`` tokens; raises Unavailable if none is healthy."""
    if hint is not None:
        preferred, reason, other_reason = hint, "hint", "fallback"
    elif prompt_tokens <= edge_max_prompt_tokens:
        preferred, reason, other_reason = TierName.EDGE, "prompt_short", "spill"
    else:
        preferred, reason, other_reason = TierName.CLOUD, "prompt_long", "spill"
    if preferred in healthy:
        return TierChoice(preferred, reason)
    if preferred.other in healthy:
        return TierChoice(preferred.other, other_reason)
    raise Unavailable("no healthy worker can serve this request right now; retry in a few seconds")


T = TypeVar("T")


class RoundRobin:
    """Round-robin over a changing list of candidates, one cursor per tier."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, group: str, candidates: Sequence[T], exclude: Collection[T] = ()) -> T | None:
        """The next candidate of ``group`` not in ``exclude``; None when there is none."""
        allowed = [c for c in candidates if c not in exclude]
        if not allowed:
            return None
        i = self._next.get(group, 0)
        self._next[group] = i + 1
        return allowed[i % len(allowed)]
