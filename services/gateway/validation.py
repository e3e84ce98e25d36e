"""Request checks the gateway does before anything is forwarded.

Each failure raises :class:`InvalidArgument` with one sentence that names the field and the fix.
Token-level limits (prompt longer than the model's context) are the router's job: only it tokenizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb

CHAT_ROLES = frozenset({"system", "user", "assistant"})
MAX_PRIORITY = 9


@dataclass(frozen=True)
class Limits:
    """The limits a request must respect (from :class:`GatewaySettings`)."""

    max_prompt_chars: int = 32_000
    max_tokens: int = 4096
    max_stop_strings: int = 8
    max_stop_chars: int = 64
    max_chat_messages: int = 64
    max_model_chars: int = 128


def validate_sampling(sampling: pb.SamplingParams, limits: Limits) -> None:
    if sampling.max_tokens > limits.max_tokens:
        raise InvalidArgument(
            f"sampling.max_tokens is {sampling.max_tokens}, above the limit of {limits.max_tokens}; ask for fewer"
        )
    if not math.isfinite(sampling.temperature) or not 0.0 <= sampling.temperature <= 2.0:
        raise InvalidArgument(f"sampling.temperature must be between 0 and 2 (got {sampling.temperature:g})")
    if not math.isfinite(sampling.top_p) or not 0.0 <= sampling.top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p must be between 0 and 1 (got {sampling.top_p:g}); 0 disables it")
    if len(sampling.stop) > limits.max_stop_strings:
        raise InvalidArgument(f"sampling.stop has {len(sampling.stop)} strings; send at most {limits.max_stop_strings}")
    for stop in sampling.stop:
        if not stop:
            raise InvalidArgument("sampling.stop contains an empty string; remove it")
        if len(stop) > limits.max_stop_chars:
            raise InvalidArgument(
                f"a stop string is {len(stop)} characters long; keep each under {limits.max_stop_chars + 1}"
            )


def validate_routing(routing: pb.RoutingOptions) -> None:
    if routing.tier not in pb.Tier.values():
        raise InvalidArgument(f"routing.tier {routing.tier} is unknown; use TIER_AUTO, TIER_EDGE or TIER_CLOUD")
    if routing.cache_policy not in pb.CachePolicy.values():
        raise InvalidArgument(f"routing.cache_policy {routing.cache_policy} is unknown; see the CachePolicy enum")
    if routing.priority > MAX_PRIORITY:
        raise InvalidArgument(f"routing.priority must be 0 to {MAX_PRIORITY} (got {routing.priority})")


def _validate_model(model: str, limits: Limits) -> None:
    if len(model) > limits.max_model_chars:
        raise InvalidArgument(f"model id is longer than {limits.max_model_chars} characters; use an id from ListModels")


def validate_generate(request: pb.GenerateRequest, limits: Limits) -> None:
    """Checks of a Generate/Complete request."""
    if not request.prompt.strip():
        raise InvalidArgument("prompt is empty; send the text to complete")
    if len(request.prompt) > limits.max_prompt_chars:
        raise InvalidArgument(
            f"prompt is {len(request.prompt)} characters long, above the limit of {limits.max_prompt_chars}; shorten it"
        )
    _validate_model(request.model, limits)
    validate_sampling(request.sampling, limits)
    validate_routing(request.routing)


def validate_chat_request(request: pb.ChatRequest, limits: Limits) -> None:
    """Checks of one client frame of a Chat stream."""
    action = request.WhichOneof("action")
    if action is None:
        raise InvalidArgument("chat frame has neither a turn nor a cancel; set one of them")
    if action == "cancel":
        return
    turn = request.turn
    if not turn.messages:
        raise InvalidArgument("chat turn has no messages; send at least one user message")
    if len(turn.messages) > limits.max_chat_messages:
        raise InvalidArgument(
            f"chat turn has {len(turn.messages)} messages; send at most {limits.max_chat_messages} per turn"
        )
    total = 0
    for index, message in enumerate(turn.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{index}].role is {message.role[:20]!r}; use 'system', 'user' or 'assistant'"
            )
        total += len(message.content)
    if not any(m.content.strip() for m in turn.messages):
        raise InvalidArgument("chat turn has only empty messages; send some text")
    if total > limits.max_prompt_chars:
        raise InvalidArgument(
            f"chat turn has {total} characters of messages, above the limit of {limits.max_prompt_chars}; shorten it"
        )
    _validate_model(turn.model, limits)
    validate_sampling(turn.sampling, limits)
    validate_routing(turn.routing)
