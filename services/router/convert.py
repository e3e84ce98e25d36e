"""Proto <-> domain for the router's Inference service: requests (sampling validation, routing options),
events, model lists. Used at the service's edges only: its gRPC servicer (services/router/servicer.py)
and the gateway's client of a remote router (services/gateway/remote_router.py)."""

from __future__ import annotations

from services.common import logprobs_pb, sampling_pb
from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.sampling import SamplingParams
from services.router.policy import TierName
from services.router.types import (
    MAX_PRIORITY,
    ChatMessage,
    ChatTurn,
    Chunk,
    Done,
    Event,
    Generation,
    ModelInfo,
    Route,
    Routing,
)

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


def routing(msg: inference_pb2.RoutingOptions) -> Routing:
    """The routing options (tier hint, cache use, shareable across tenants, priority), validated."""
    if msg.tier not in _HINTS:
        raise InvalidArgument(f"unknown routing tier {msg.tier}; use TIER_AUTO, TIER_EDGE or TIER_CLOUD")
    if msg.priority > MAX_PRIORITY:
        raise InvalidArgument(f"priority must be 0 to {MAX_PRIORITY}, got {msg.priority}")
    if msg.cache_policy not in inference_pb2.CachePolicy.values():
        raise InvalidArgument(f"unknown cache policy {msg.cache_policy}")
    policy = msg.cache_policy
    return Routing(
        hint=_HINTS[msg.tier],
        use_cache=policy != inference_pb2.CACHE_POLICY_BYPASS,
        shareable=policy == inference_pb2.CACHE_POLICY_SHAREABLE_PREFIX,
        priority=msg.priority,
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


# -- requests ------------------------------------------------------------------------------------
# max_tokens 0 stays 0 in the domain request: the router applies its own default (RouterAPI).


def generation(
    msg: inference_pb2.GenerateRequest, *, tenant: str, request_id: str, sampling: SamplingParams | None = None
) -> Generation:
    """A Generate/Complete request, its parameters validated (before anything is tokenized); ``sampling``
    when the caller already converted them (the gateway's validation), so they are converted once."""
    return Generation(
        prompt=msg.prompt,
        sampling=sampling if sampling is not None else sampling_pb.from_pb(msg.sampling),
        routing=routing(msg.routing),
        model=msg.model,
        tenant=tenant,
        request_id=request_id,
    )


def chat_turn(msg: inference_pb2.ChatTurn, sampling: SamplingParams | None = None) -> ChatTurn:
    """A chat turn, its parameters validated (``sampling``: as for :func:`generation`)."""
    return ChatTurn(
        messages=tuple(ChatMessage(m.role, m.content) for m in msg.messages),
        sampling=sampling if sampling is not None else sampling_pb.from_pb(msg.sampling, chat=True),
        routing=routing(msg.routing),
        model=msg.model,
    )


def _routing_pb(r: Routing) -> inference_pb2.RoutingOptions:
    if not r.use_cache:
        policy = inference_pb2.CACHE_POLICY_BYPASS
    elif r.shareable:
        policy = inference_pb2.CACHE_POLICY_SHAREABLE_PREFIX
    else:
        policy = inference_pb2.CACHE_POLICY_UNSPECIFIED
    return inference_pb2.RoutingOptions(tier=_TIER_PB[r.hint], cache_policy=policy, priority=r.priority)


def generation_pb(g: Generation) -> inference_pb2.GenerateRequest:
    """The proto of a Generate/Complete request (tenant and request id travel as call metadata)."""
    return inference_pb2.GenerateRequest(
        prompt=g.prompt, model=g.model, sampling=sampling_pb.to_pb(g.sampling), routing=_routing_pb(g.routing)
    )


def chat_turn_pb(t: ChatTurn) -> inference_pb2.ChatTurn:
    return inference_pb2.ChatTurn(
        messages=[inference_pb2.ChatMessage(role=m.role, content=m.content) for m in t.messages],
        model=t.model,
        sampling=sampling_pb.to_pb(t.sampling),
        routing=_routing_pb(t.routing),
    )


# -- events and models ---------------------------------------------------------------------------

_TIER_FROM_PB = {inference_pb2.TIER_EDGE: TierName.EDGE, inference_pb2.TIER_CLOUD: TierName.CLOUD}


def done_pb(done: Done) -> inference_pb2.Final:
    return final_pb(done.finish_reason, done.prompt_tokens, done.completion_tokens, done.route)


def event(frame: inference_pb2.GenerateResponse | inference_pb2.ChatResponse) -> Event:
    """The event a response frame carries (its request id and sequence number are the transport's)."""
    if not frame.HasField("final"):
        return Chunk(list(frame.token_ids), frame.text, logprobs_pb.from_pb(frame.logprobs))
    final = frame.final
    route = Route(_TIER_FROM_PB.get(final.route.tier), final.route.worker_id, final.route.cache_hit, final.route.reason)
    return Done(int(final.finish_reason), final.usage.prompt_tokens, final.usage.completion_tokens, route)


def models_pb(models: list[ModelInfo]) -> inference_pb2.ListModelsResponse:
    return inference_pb2.ListModelsResponse(
        models=[
            inference_pb2.ModelInfo(id=m.id, tiers=[_TIER_PB[t] for t in m.tiers], context_length=m.context_length)
            for m in models
        ]
    )


def models(reply: inference_pb2.ListModelsResponse) -> list[ModelInfo]:
    return [
        ModelInfo(m.id, tuple(_TIER_FROM_PB[t] for t in m.tiers if t in _TIER_FROM_PB), m.context_length)
        for m in reply.models
    ]
