"""Proto <-> domain for the router: routing options in, route info out (sampling: services.common.sampling_pb)."""

from __future__ import annotations

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2
from services.router.core import Route
from services.router.policy import TierName

MAX_PRIORITY = 9

_HINTS = {
    inference_pb2.TIER_UNSPECIFIED: None,
    inference_pb2.TIER_AUTO: None,
    inference_pb2.TIER_EDGE: TierName.EDGE,
    inference_pb2.TIER_CLOUD: TierName.CLOUD,
}
_TIER_PB = {
    None: inference_pb2.TIER_UNSPECIFIED,
    TierName.EDGE: inference_pb2.TIER_EDGE,
    TierName.CLOUD: inference_pb2.TIER_CLOUD,
}


def routing(msg: inference_pb2.RoutingOptions) -> tuple[TierName | None, bool, bool]:
    """(tier hint, use the cache, shareable across tenants) from routing options."""
    if msg.tier not in _HINTS:
        raise InvalidArgument(f"unknown routing tier {msg.tier}; use TIER_AUTO, TIER_EDGE or TIER_CLOUD")
    if msg.priority > MAX_PRIORITY:
        raise InvalidArgument(f"priority must be 0 to {MAX_PRIORITY}, got {msg.priority}")
    if msg.cache_policy not in inference_pb2.CachePolicy.values():
        raise InvalidArgument(f"unknown cache policy {msg.cache_policy}")
    policy = msg.cache_policy
    use_cache = policy != inference_pb2.CACHE_POLICY_BYPASS
    return _HINTS[msg.tier], use_cache, policy == inference_pb2.CACHE_POLICY_SHAREABLE_PREFIX


def route_pb(route: Route) -> inference_pb2.RouteInfo:
    return inference_pb2.RouteInfo(
        tier=_TIER_PB[route.tier], worker_id=route.worker_id, cache_hit=route.cache_hit, reason=route.reason
    )


def final_pb(finish_reason: int, prompt_tokens: int, completion_tokens: int, route: Route) -> inference_pb2.Final:
    return inference_pb2.Final(
        finish_reason=finish_reason,  # type: ignore[arg-type]
        usage=inference_pb2.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ),
        route=route_pb(route),
    )
