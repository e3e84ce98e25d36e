"""Request checks the gateway does before anything is forwarded.

Each failure raises :class:`InvalidArgument` with one sentence that names the field and the fix.
Sampling is checked by the mesh's one validator (:mod:`services.common.sampling`) under the operator's
limits; token-level limits (prompt longer than the model's context) are the router's job: only it
tokenizes.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

from services.common.constraints import COMPILE_TIMEOUT_S, FIELD, Constraint, check_grammar
from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingLimits, SamplingParams
from services.common.sampling_pb import from_pb
from services.router.tools import MAX_TOOL_CALL_ID_CHARS, MAX_TOOL_CALLS, MAX_TOOL_NAME_CHARS
from services.router.types import MAX_PRIORITY

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class Limits:
    """The limits a request must respect (from :class:`GatewaySettings`)."""

    max_prompt_chars: int = 32_000
    max_tokens: int = 4096
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS
    max_chat_messages: int = 64
    max_model_chars: int = 128
    max_embed_inputs: int = 2048
    max_embed_chars: int = 1_000_000

    @cached_property
    def sampling(self) -> SamplingLimits:
        """The sampling part, for :func:`services.common.sampling.resolve_sampling`."""
        return SamplingLimits(
            max_tokens=self.max_tokens, max_stop_strings=self.max_stop_strings, max_stop_chars=self.max_stop_chars
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


def validate_generate(request: pb.GenerateRequest, limits: Limits) -> SamplingParams:
    """Checks of a Generate/Complete request; returns its sampling, checked (``max_tokens`` not yet fitted)."""
    if not request.prompt.strip():
        raise InvalidArgument("prompt is empty; send the text to complete")
    if len(request.prompt) > limits.max_prompt_chars:
        raise InvalidArgument(
            f"prompt is {len(request.prompt)} characters long, above the limit of {limits.max_prompt_chars}; shorten it"
        )
    _validate_model(request.model, limits)
    sampling = from_pb(request.sampling, limits.sampling)
    validate_routing(request.routing)
    return sampling


def validate_chat_request(request: pb.ChatRequest, limits: Limits) -> SamplingParams | None:
    """Checks of one client frame of a Chat stream; returns a turn's sampling, checked (None for a cancel)."""
    action = request.WhichOneof("action")
    if action is None:
        raise InvalidArgument("chat frame has neither a turn nor a cancel; set one of them")
    if action == "cancel":
        return None
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
                f"messages[{index}].role is {message.role[:20]!r}; use 'system', 'user', 'assistant' or 'tool'"
            )
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidArgument(
                f"messages[{index}] is a tool message without tool_call_id; set it to the id of the call it answers"
            )
        if len(message.tool_call_id) > MAX_TOOL_CALL_ID_CHARS:
            raise InvalidArgument(
                f"messages[{index}].tool_call_id is longer than {MAX_TOOL_CALL_ID_CHARS} characters; "
                "send the id of the call it answers"
            )
        if len(message.name) > MAX_TOOL_NAME_CHARS:
            raise InvalidArgument(f"messages[{index}].name is longer than {MAX_TOOL_NAME_CHARS} characters")
        if message.tool_calls and message.role != "assistant":
            raise InvalidArgument(f"messages[{index}] has tool_calls but is not an assistant message")
        if len(message.tool_calls) > MAX_TOOL_CALLS:
            raise InvalidArgument(
                f"messages[{index}].tool_calls has {len(message.tool_calls)} calls; send at most {MAX_TOOL_CALLS}"
            )
        total += len(message.content) + sum(len(c.arguments) for c in message.tool_calls)
    if not any(m.content.strip() or m.tool_calls for m in turn.messages):
        raise InvalidArgument("chat turn has only empty messages; send some text")
    if total > limits.max_prompt_chars:
        raise InvalidArgument(
            f"chat turn has {total} characters of messages, above the limit of {limits.max_prompt_chars}; shorten it"
        )
    _validate_model(turn.model, limits)
    sampling = from_pb(turn.sampling, limits.sampling)
    validate_routing(turn.routing)
    return sampling


def validate_embed(request: pb.EmbedRequest, limits: Limits) -> None:
    """Checks of an Embed request: input count, each input set and not too long, the total size."""
    if not request.inputs:
        raise InvalidArgument("inputs is empty; send at least one text or token id list to embed")
    if len(request.inputs) > limits.max_embed_inputs:
        raise InvalidArgument(
            f"inputs has {len(request.inputs)} entries, above the limit of {limits.max_embed_inputs}; split the request"
        )
    chars = ids = 0
    for i, item in enumerate(request.inputs):
        if bool(item.text) == bool(item.token_ids):
            raise InvalidArgument(f"inputs[{i}] must set exactly one of text and token_ids (a non-empty one)")
        if len(item.text) > limits.max_prompt_chars:
            raise InvalidArgument(
                f"inputs[{i}] is {len(item.text)} characters long, above the limit of {limits.max_prompt_chars};"
                " shorten it"
            )
        chars += len(item.text)
        ids += len(item.token_ids)
    if chars > limits.max_embed_chars or ids > limits.max_embed_chars:
        what = f"{chars} characters" if chars > limits.max_embed_chars else f"{ids} token ids"
        raise InvalidArgument(
            f"inputs hold {what} together, above the limit of {limits.max_embed_chars}; split the request"
        )
    _validate_model(request.model, limits)


class GrammarChecks:
    """The gateway's check of a structured-output constraint before it is forwarded (llguidance's grammar
    check, without the vocabulary: a worker's compile error would reach the caller only as a generic
    message). Runs in a thread, bounded by ``timeout_s``; constraints that passed are remembered (LRU)."""

    def __init__(self, timeout_s: float = COMPILE_TIMEOUT_S, entries: int = 256) -> None:
        self.timeout_s = timeout_s
        self._passed: OrderedDict[str, None] = OrderedDict()
        self._entries = entries

    async def check(self, sampling: SamplingParams | None) -> None:
        constraint: Constraint | None = None if sampling is None else sampling.structured
        if constraint is None:
            return
        if constraint.digest in self._passed:
            self._passed.move_to_end(constraint.digest)
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(check_grammar, constraint), self.timeout_s)
        except TimeoutError:
            raise InvalidArgument(
                f"{FIELD}: the {constraint.kind} did not compile within the limit of {self.timeout_s:g} s; "
                "simplify it (fewer alternatives, smaller counted repetitions)"
            ) from None
        self._passed[constraint.digest] = None
        while len(self._passed) > self._entries:
            self._passed.popitem(last=False)
