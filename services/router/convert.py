"""Proto -> domain for the router: sampling defaults and validation, routing options, route info."""

from __future__ import annotations

import math

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2
from services.router.core import Route
from services.router.policy import TierName
from services.store.keys import SamplingSpec

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
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


def sampling(msg: inference_pb2.SamplingParams, default_max_tokens: int) -> SamplingSpec:
    """Validated sampling parameters with defaults applied (max_tokens 0 -> default, top_p 0 -> 1)."""
    t, p = float(msg.temperature), float(msg.top_p)
    if not math.isfinite(t) or not 0.0 <= t <= 2.0:
        raise InvalidArgument(f"temperature must be between 0 and 2, got {t:g}")
    if not math.isfinite(p) or not 0.0 <= p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1] (0 means 1), got {p:g}")
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(msg.stop)}")
    for s in msg.stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop strings must be 1 to {MAX_STOP_CHARS} characters long")
    return SamplingSpec(
        max_tokens=msg.max_tokens or default_max_tokens,
        temperature=t,
        top_p=p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
    )


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


def check_length(prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    if prompt_tokens == 0:
        raise InvalidArgument("the prompt is empty; send at least one character of text")
    if prompt_tokens + max_tokens > context_length:
        raise InvalidArgument(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context of "
            f"{context_length} tokens; shorten the prompt or lower max_tokens"
        )


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
