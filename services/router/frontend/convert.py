"""Proto <-> domain for the router's Inference service: requests (sampling validation, routing options),
events, model lists, embeddings. Used at the service's edges only: its gRPC servicer
(services/router/frontend/servicer.py) and the gateway's client of a remote router
(services/gateway/remote_router.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from services.common import logprobs_pb, sampling_pb
from services.common.errors import InvalidArgument
from services.common.generation_defaults import GenerationDefaults
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.sampling import SamplingParams
from services.router.balancer.tiers import TierName
from services.router.tools import (
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOL_NAME_CHARS,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    check_tool_call,
    check_tools,
    parse_parameters,
)
from services.router.types import (
    MAX_PRIORITY,
    ChatMessage,
    ChatTurn,
    Chunk,
    Done,
    Embeddings,
    EmbedQuery,
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
        background=msg.background,
    )


def route_pb(route: Route) -> inference_pb2.RouteInfo:
    return inference_pb2.RouteInfo(
        tier=_TIER_PB[route.tier], worker_id=route.worker_id, cache_hit=route.cache_hit, reason=route.reason
    )


def final_pb(
    finish_reason: int, prompt_tokens: int, completion_tokens: int, route: Route, budget_closed: bool = False
) -> inference_pb2.Final:
    return inference_pb2.Final(
        finish_reason=finish_reason,  # type: ignore[arg-type]
        usage=inference_pb2.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            budget_closed=budget_closed,
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


_CHOICE = {
    inference_pb2.TOOL_CHOICE_AUTO: ToolChoiceMode.AUTO,
    inference_pb2.TOOL_CHOICE_NONE: ToolChoiceMode.NONE,
    inference_pb2.TOOL_CHOICE_REQUIRED: ToolChoiceMode.REQUIRED,
    inference_pb2.TOOL_CHOICE_FUNCTION: ToolChoiceMode.FUNCTION,
}
_CHOICE_PB = {mode: number for number, mode in _CHOICE.items()}


def _message(m: inference_pb2.ChatMessage, index: int) -> ChatMessage:
    if len(m.name) > MAX_TOOL_NAME_CHARS:
        raise InvalidArgument(f"messages[{index}].name is longer than {MAX_TOOL_NAME_CHARS} characters")
    if len(m.tool_call_id) > MAX_TOOL_CALL_ID_CHARS:
        raise InvalidArgument(f"messages[{index}].tool_call_id is longer than {MAX_TOOL_CALL_ID_CHARS} characters")
    if len(m.tool_calls) > MAX_TOOL_CALLS:
        raise InvalidArgument(
            f"messages[{index}].tool_calls has {len(m.tool_calls)} calls; send at most {MAX_TOOL_CALLS}"
        )
    calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls)
    for i, call in enumerate(calls):
        check_tool_call(call, f"messages[{index}].tool_calls[{i}]")
    return ChatMessage(m.role, m.content, m.name, m.tool_call_id, calls)


def _tools(msg: inference_pb2.ChatTurn) -> tuple[tuple[Tool, ...], ToolChoice | None]:
    """The turn's tools and tool choice, checked (services/router/tools.py)."""
    tools = tuple(
        Tool(t.name, t.description, parse_parameters(t.parameters_json, f"tools[{i}].function.parameters"))
        for i, t in enumerate(msg.tools)
    )
    choice = None
    if msg.HasField("tool_choice"):
        pb_choice = msg.tool_choice
        if pb_choice.mode not in inference_pb2.ToolChoiceMode.values():
            raise InvalidArgument(f"tool_choice.mode {pb_choice.mode} is unknown; see the ToolChoiceMode enum")
        parallel = pb_choice.parallel_tool_calls if pb_choice.HasField("parallel_tool_calls") else True
        mode = _CHOICE.get(pb_choice.mode)
        if mode is None:  # unspecified: the default mode, with the parallel setting given
            mode = ToolChoiceMode.AUTO if tools else ToolChoiceMode.NONE
        choice = ToolChoice(mode, pb_choice.function_name if mode is ToolChoiceMode.FUNCTION else "", parallel)
    check_tools(tools, choice or ToolChoice())
    return tools, choice


def chat_turn(msg: inference_pb2.ChatTurn, sampling: SamplingParams | None = None) -> ChatTurn:
    """A chat turn, its parameters validated (``sampling``: as for :func:`generation`; tools and tool
    messages: against the limits of services/router/tools.py)."""
    tools, choice = _tools(msg)
    return ChatTurn(
        messages=tuple(_message(m, i) for i, m in enumerate(msg.messages)),
        sampling=sampling if sampling is not None else sampling_pb.from_pb(msg.sampling),
        routing=routing(msg.routing),
        model=msg.model,
        tools=tools,
        tool_choice=choice,
    )


def _routing_pb(r: Routing) -> inference_pb2.RoutingOptions:
    if not r.use_cache:
        policy = inference_pb2.CACHE_POLICY_BYPASS
    elif r.shareable:
        policy = inference_pb2.CACHE_POLICY_SHAREABLE_PREFIX
    else:
        policy = inference_pb2.CACHE_POLICY_UNSPECIFIED
    return inference_pb2.RoutingOptions(
        tier=_TIER_PB[r.hint], cache_policy=policy, priority=r.priority, background=r.background
    )


def generation_pb(g: Generation) -> inference_pb2.GenerateRequest:
    """The proto of a Generate/Complete request (tenant and request id travel as call metadata)."""
    return inference_pb2.GenerateRequest(
        prompt=g.prompt, model=g.model, sampling=sampling_pb.to_pb(g.sampling), routing=_routing_pb(g.routing)
    )


def _message_pb(m: ChatMessage) -> inference_pb2.ChatMessage:
    return inference_pb2.ChatMessage(
        role=m.role,
        content=m.content,
        name=m.name,
        tool_call_id=m.tool_call_id,
        tool_calls=[inference_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls],
    )


def chat_turn_pb(t: ChatTurn) -> inference_pb2.ChatTurn:
    msg = inference_pb2.ChatTurn(
        messages=[_message_pb(m) for m in t.messages],
        model=t.model,
        sampling=sampling_pb.to_pb(t.sampling),
        routing=_routing_pb(t.routing),
        tools=[
            inference_pb2.Tool(
                name=tool.name,
                description=tool.description,
                parameters_json=json.dumps(tool.parameters) if tool.parameters else "",
            )
            for tool in t.tools
        ],
    )
    if t.tool_choice is not None:
        c = t.tool_choice
        msg.tool_choice.CopyFrom(
            inference_pb2.ToolChoice(
                mode=_CHOICE_PB[c.mode], function_name=c.function_name, parallel_tool_calls=c.parallel
            )
        )
    return msg


def tool_calls_pb(deltas: Sequence[ToolCallDelta]) -> list[inference_pb2.ToolCallDelta]:
    return [inference_pb2.ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments) for d in deltas]


# -- events and models ---------------------------------------------------------------------------

_TIER_FROM_PB = {inference_pb2.TIER_EDGE: TierName.EDGE, inference_pb2.TIER_CLOUD: TierName.CLOUD}


def done_pb(done: Done) -> inference_pb2.Final:
    return final_pb(done.finish_reason, done.prompt_tokens, done.completion_tokens, done.route, done.budget_closed)


def event(frame: inference_pb2.GenerateResponse | inference_pb2.ChatResponse, last: bool = True) -> Event:
    """The event a response frame carries (its request id and sequence number are the transport's);
    ``last``: a final frame is its turn's last (the n-th of n choices: the caller counts them)."""
    if not frame.HasField("final"):
        calls = getattr(frame, "tool_calls", ())  # a GenerateResponse has none
        deltas = tuple(ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in calls)
        return Chunk(list(frame.token_ids), frame.text, deltas, frame.index, logprobs_pb.from_pb(frame.logprobs))
    final = frame.final
    route = Route(_TIER_FROM_PB.get(final.route.tier), final.route.worker_id, final.route.cache_hit, final.route.reason)
    return Done(
        int(final.finish_reason),
        final.usage.prompt_tokens,
        final.usage.completion_tokens,
        route,
        frame.index,
        last,
        final.usage.budget_closed,
    )


class FinalCounter:
    """Tells which final frame ends a turn of n choices (the n-th), for :func:`event`'s ``last``."""

    def __init__(self, n: int = 1) -> None:
        self.left = n

    def last(self, frame: inference_pb2.GenerateResponse | inference_pb2.ChatResponse) -> bool:
        if frame.HasField("final"):
            self.left -= 1
        return self.left <= 0


def defaults_pb(d: GenerationDefaults) -> inference_pb2.GenerationDefaults:
    msg = inference_pb2.GenerationDefaults(max_tokens=d.max_tokens or 0, stop=list(d.stop or ()))
    if d.temperature is not None:
        msg.temperature = d.temperature
    if d.top_p is not None:
        msg.top_p = d.top_p
    if d.top_k is not None:
        msg.top_k = d.top_k
    if d.repetition_penalty is not None:
        msg.repetition_penalty = d.repetition_penalty
    return msg


def defaults(msg: inference_pb2.GenerationDefaults) -> GenerationDefaults:
    """As the router sent them (float32 on the wire: 0.2 arrives as 0.200000003, so rounded to 6 digits)."""

    def number(name: str) -> float | None:
        return round(float(getattr(msg, name)), 6) if msg.HasField(name) else None  # type: ignore[arg-type]

    return GenerationDefaults(
        temperature=number("temperature"),
        top_p=number("top_p"),
        top_k=msg.top_k if msg.HasField("top_k") else None,
        repetition_penalty=number("repetition_penalty"),
        max_tokens=msg.max_tokens or None,
        stop=tuple(msg.stop) or None,
    )


def models_pb(models: list[ModelInfo]) -> inference_pb2.ListModelsResponse:
    return inference_pb2.ListModelsResponse(
        models=[
            inference_pb2.ModelInfo(
                id=m.id,
                tiers=[_TIER_PB[t] for t in m.tiers],
                context_length=m.context_length,
                generation_defaults=defaults_pb(m.generation_defaults),
                state=m.state,
            )
            for m in models
        ]
    )


def models(reply: inference_pb2.ListModelsResponse) -> list[ModelInfo]:
    return [
        ModelInfo(
            m.id,
            tuple(_TIER_FROM_PB[t] for t in m.tiers if t in _TIER_FROM_PB),
            m.context_length,
            defaults(m.generation_defaults),
            m.state,
        )
        for m in reply.models
    ]


def embed_query(msg: inference_pb2.EmbedRequest, *, tenant: str = "", request_id: str = "") -> EmbedQuery:
    """The inputs of an EmbedRequest (each must set exactly one of text and token_ids)."""
    inputs: list[str | list[int]] = []
    for i, item in enumerate(msg.inputs):
        if bool(item.text) == bool(item.token_ids):
            raise InvalidArgument(f"inputs[{i}] must set exactly one of text and token_ids; it sets {_which(item)}")
        inputs.append(item.text or list(item.token_ids))
    return EmbedQuery(inputs, msg.dimensions, msg.model, tenant, request_id)


def _which(item: inference_pb2.EmbedInput) -> str:
    return "both" if item.text else "neither"


def embed_query_pb(q: EmbedQuery) -> inference_pb2.EmbedRequest:
    return inference_pb2.EmbedRequest(
        model=q.model,
        dimensions=q.dimensions,
        inputs=[
            inference_pb2.EmbedInput(text=x) if isinstance(x, str) else inference_pb2.EmbedInput(token_ids=x)
            for x in q.inputs
        ],
    )


def embeddings_pb(e: Embeddings, request_id: str = "") -> inference_pb2.EmbedResponse:
    return inference_pb2.EmbedResponse(
        request_id=request_id,
        embeddings=[inference_pb2.Embedding(values=v) for v in e.vectors],
        usage=inference_pb2.Usage(prompt_tokens=e.prompt_tokens, total_tokens=e.prompt_tokens),
        route=route_pb(e.route),
    )


def embeddings(reply: inference_pb2.EmbedResponse) -> Embeddings:
    route = reply.route
    return Embeddings(
        [list(e.values) for e in reply.embeddings],
        reply.usage.prompt_tokens,
        Route(_TIER_FROM_PB.get(route.tier), route.worker_id, route.cache_hit, route.reason),
    )
