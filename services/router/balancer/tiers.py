"""Tier choice: which tier serves a prompt. Pure functions, no grpc, no I/O; the replica within the tier is
the replica policy's (services/router/balancer/policies/).

Tier choice (:func:`choose_tier`), in order:

1. a tenant restricted to some tiers (tenant policy) is only ever routed inside them;
2. an explicit hint (edge/cloud) is honoured when that tier has a usable replica (reason "hint"),
   otherwise the other tier serves (reason "fallback");
3. prompts of at most ``edge_max_prompt_tokens`` go to the edge ("prompt_short"), longer ones to
   the cloud ("prompt_long"); when that tier has no healthy replica the other one serves ("spill"),
   and when every replica of it is saturated while the other tier has room, too ("spill_saturated").
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

from services.common.errors import Unavailable


class TierName(StrEnum):
    """A worker tier as the router's policy names it."""

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
    saturated: Collection[TierName] = (),
    allowed: Collection[TierName] | None = None,
) -> TierChoice:
    """Pick the tier for a prompt of ``prompt_tokens`` tokens; raises Unavailable if none is usable.

    ``saturated``: healthy tiers whose every replica is at capacity. ``allowed``: the tenant's tiers
    (None = all).
    """
    usable = {t for t in healthy if allowed is None or t in allowed}
    if hint is not None:
        preferred, reason, other_reason = hint, "hint", "fallback"
    elif prompt_tokens <= edge_max_prompt_tokens:
        preferred, reason, other_reason = TierName.EDGE, "prompt_short", "spill"
    else:
        preferred, reason, other_reason = TierName.CLOUD, "prompt_long", "spill"
    if preferred in usable:
        if preferred in saturated and preferred.other in usable and preferred.other not in saturated:
            return TierChoice(preferred.other, "spill_saturated")
        return TierChoice(preferred, reason)
    if preferred.other in usable:
        return TierChoice(preferred.other, other_reason)
    raise Unavailable("no healthy worker can serve this request right now; retry in a few seconds")
