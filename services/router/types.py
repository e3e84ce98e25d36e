"""The router's API in domain types: what a caller asks, what it gets back, and its admission.

No transport here: the gateway builds these in its own process (the embedded layout) and the
router's gRPC servicer builds them from protos (the split layout); :mod:`services.router.frontend.convert`
is the only place that knows both.

A caller asks :class:`~services.router.frontend.api.RouterAPI` for a :class:`Generation` (a prompt) or a
chat's :class:`ChatTurn` (messages) and gets a stream of :class:`Chunk` events ending with one
:class:`Done`. Request ids and frame sequence numbers are not part of the events: whoever writes
frames stamps them, once.

**Admission** (:class:`PendingAdmission`): a caller may start the router on a request while its own
rate-limit reservation is still running. The router then does everything that costs no worker
anything (tokenize, look up the cache, choose a replica, open the worker call) but awaits
:meth:`PendingAdmission.wait` before it sends the worker any work, and the caller must await the same
reservation before it passes anything on. With ``speculative`` set, the router starts the worker
before the reservation is known, so the Redis round trip overlaps the prefill instead of delaying
it; a refusal then aborts the worker's turn at once and the stream raises the refusal.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.generation_defaults import NO_DEFAULTS, GenerationDefaults
from services.common.logprobs import TokenLogprob
from services.common.sampling import SamplingParams
from services.router.balancer.tiers import TierName
from services.router.tools import Tool, ToolCall, ToolCallDelta, ToolChoice

MAX_PRIORITY = 9
"""The highest priority class (0 is the default); every check of ``priority`` uses this."""


@dataclass(frozen=True)
class Routing:
    """How the caller wants a request routed."""

    hint: TierName | None = None
    """The tier asked for; None lets the router choose."""
    use_cache: bool = True
    """False: neither read nor write the response cache, never join an identical request in flight."""
    shareable: bool = False
    """The prompt may share caches across tenants (no tenant salt)."""
    priority: int = 0
    """0 to :data:`MAX_PRIORITY`; higher is served first under load (the gateway caps it at the tenant's policy)."""
    background: bool = False
    """Background work (a batch line): the workers that can yield run it only in steps that prefill no other turn."""


@dataclass(frozen=True)
class Generation:
    """One prompt to complete. ``sampling.max_tokens`` 0 means the router's default."""

    prompt: str
    sampling: SamplingParams
    routing: Routing = Routing()
    model: str = ""
    """The model id asked for; empty: the router's."""
    tenant: str = ""
    request_id: str = ""
    """For the worker's logs and traces; the router does not stamp it on events."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    """``system``, ``user``, ``assistant`` or ``tool``."""
    content: str
    name: str = ""
    tool_call_id: str = ""
    """A ``tool`` message: the call it answers."""
    tool_calls: tuple[ToolCall, ...] = ()
    """An ``assistant`` message: the calls it made."""

    def as_dict(self) -> dict[str, Any]:
        """As the chat template takes it (OpenAI's message shape; services/common/chat_tools.py)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return out


@dataclass(frozen=True)
class ChatTurn:
    """One turn of a chat: the new messages (the conversation so far is the session's).
    ``sampling.max_tokens`` 0 means the router's default."""

    messages: Sequence[ChatMessage]
    sampling: SamplingParams
    routing: Routing = Routing()
    model: str = ""
    tools: tuple[Tool, ...] = ()
    """Functions the model may call in this turn (services/router/tools.py)."""
    tool_choice: ToolChoice | None = None
    """None: ``auto`` with tools, ``none`` without."""


@dataclass(frozen=True)
class Route:
    """Where a turn was served."""

    tier: TierName | None
    worker_id: str
    cache_hit: bool
    reason: str


@dataclass(frozen=True)
class Chunk:
    """Tokens (and their text) of a turn, as they reach the caller."""

    token_ids: Sequence[int]
    text: str
    tool_calls: Sequence[ToolCallDelta] = ()
    """Tool-call deltas these tokens completed (chat turns with tools); their markup is not in ``text``."""
    index: int = 0
    """The choice (0 to n-1 of ``SamplingParams.n``) the tokens belong to."""
    logprobs: Sequence[TokenLogprob] = ()
    """With ``sampling.logprobs``: one entry per token id, in order (empty otherwise)."""


@dataclass(frozen=True)
class Done:
    """A turn's end: finish reason (a :class:`FinishReason` value), token counts and where it was served."""

    finish_reason: int
    prompt_tokens: int
    completion_tokens: int
    route: Route
    index: int = 0
    """The choice that ended. With n > 1 choices a turn has n Dones, one per choice after its last
    chunk; ``prompt_tokens`` is the prompt's in each, ``completion_tokens`` that choice's."""
    last: bool = True
    """The turn's last event (its n-th Done)."""
    budget_closed: bool = False
    """Structured output: the answer was closed validly because max_tokens was about to run out (the
    worker's mask forced its ending; docs/structured_output.md); the caller sees it in the usage details."""


@dataclass(frozen=True)
class EmbedQuery:
    """Inputs to embed: texts (tokenized by the router, no chat template) or token id lists.

    ``dimensions`` 0 means the model's hidden size (see ``meshserve.v1.EmbedRequest``)."""

    inputs: Sequence[str | Sequence[int]]
    dimensions: int = 0
    model: str = ""
    tenant: str = ""
    request_id: str = ""


@dataclass(frozen=True)
class Embeddings:
    """One unit vector per input, in input order; the inputs' tokens; where they were computed."""

    vectors: Sequence[Sequence[float]]
    prompt_tokens: int
    route: Route


Event = Chunk | Done
"""What a generation streams: chunks, then one Done (with n > 1 choices: chunks and Dones of the
choices interleaved, each choice's Done after its chunks, the last Done marked ``last``)."""


@dataclass(frozen=True)
class TurnEvent:
    """An event of a chat, with the index of the turn it belongs to (0 for the first turn)."""

    turn: int
    event: Event


def merge(first: Event, then: Event) -> Chunk | None:
    """Two chunks that waited for the writer, as one (a Done stays an event of its own)."""
    if isinstance(first, Chunk) and isinstance(then, Chunk) and first.index == then.index:
        calls = merge_deltas(first.tool_calls, then.tool_calls) if then.tool_calls else first.tool_calls
        return Chunk(
            [*first.token_ids, *then.token_ids],
            first.text + then.text,
            calls,
            first.index,
            (*first.logprobs, *then.logprobs),
        )
    return None


def merge_deltas(first: Sequence[ToolCallDelta], then: Sequence[ToolCallDelta]) -> list[ToolCallDelta]:
    """Two runs of tool-call deltas as one: a delta that only continues the previous one's call (same
    index, no id) is appended to its arguments, so a frame holds one delta per call, as OpenAI's."""
    out = list(first)
    for delta in then:
        if out and out[-1].index == delta.index and not delta.id:
            last = out.pop()
            out.append(ToolCallDelta(last.index, last.id, last.name, last.arguments + delta.arguments))
        else:
            out.append(delta)
    return out


def is_done(event: Event) -> bool:
    return isinstance(event, Done)


def merge_turn(first: TurnEvent, then: TurnEvent) -> TurnEvent | None:
    """:func:`merge` for chat events; events of two turns stay apart."""
    if first.turn != then.turn or (merged := merge(first.event, then.event)) is None:
        return None
    return TurnEvent(first.turn, merged)


@dataclass(frozen=True)
class ModelInfo:
    """A model the router serves."""

    id: str
    tiers: tuple[TierName, ...]
    context_length: int
    generation_defaults: GenerationDefaults = NO_DEFAULTS
    """What a request leaving a sampling field unset gets (the primary version's defaults)."""
    state: str = ""
    """``awake``, ``waking``, ``asleep`` or ``stopped``: its primary version's replicas
    (services/router/balancer/wake.py ``version_state``); "" from a router before scale from zero."""


@dataclass
class TurnRequest:
    """One generation to serve, tokenized: prompt ids already validated against the context length."""

    prompt_ids: list[int]
    sampling: SamplingParams
    hint: TierName | None
    use_cache: bool
    shareable: bool
    tenant: str
    request_id: str
    timeout: float | None = None
    """Seconds the worker call may take (the caller's deadline, when it has one)."""
    priority: int = 0
    background: bool = False
    """Background work (:attr:`Routing.background`)."""
    prefix_blocks: list[bytes] | None = None
    """Block hashes of the prompt, computed once by the router."""
    tools_key: str = ""
    """A chat turn's tools and tool choice, for the response-cache key ("" without tools)."""


@dataclass
class PendingAdmission:
    """A caller's admission still in flight (see the module docstring): ``decision`` resolves when the
    caller's reservation is granted and raises the caller's error when it is refused."""

    decision: asyncio.Future[Any]
    speculative: bool = False
    """The worker may start before the decision is known (its output still waits for it)."""

    async def wait(self) -> None:
        """Return once the reservation is granted; raise the caller's error if it is refused."""
        await asyncio.shield(self.decision)  # cancelling this waiter must not cancel the reservation

    def may_start_early(self) -> bool:
        """Whether the worker may start now, before the decision (speculative and still undecided)."""
        return self.speculative and not self.decision.done()

    def refusal(self) -> BaseException | None:
        """The caller's error once the reservation has been refused; None before or when granted."""
        if not self.decision.done() or self.decision.cancelled():
            return None
        return self.decision.exception()

    def on_refused(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` as soon as the reservation is refused (never if it is granted)."""

        def done(future: asyncio.Future[Any]) -> None:
            if not future.cancelled() and future.exception() is not None:
                callback()

        self.decision.add_done_callback(done)


async def admitted(admission: PendingAdmission | None) -> None:
    """Wait for ``admission`` if there is one (None: the caller was admitted before it called)."""
    if admission is not None:
        await admission.wait()


class ChatChannel(Protocol):
    """A chat with the router: turns (and cancels) in, :class:`TurnEvent`\\ s out."""

    async def send(self, turn: ChatTurn) -> bool:
        """Queue a turn; False once the chat takes no more (it ended, or is ending with an error)."""
        ...

    async def cancel_turn(self) -> None:
        """End the turn in progress early (it still ends with a Done, CANCELLED)."""
        ...

    async def end(self) -> None:
        """No more turns: the events end after those of the turns sent."""
        ...

    def events(self) -> AsyncGenerator[TurnEvent, None]:
        """Every turn's events in order; closing it ends the chat."""
        ...


class InferenceRouter(Protocol):
    """What a caller of the router relies on: the router in this process
    (:class:`~services.router.frontend.api.RouterAPI`) or a client of one in another
    (services/gateway/remote_router.py)."""

    overlaps_admission: bool
    """Whether a pending admission lets the router prepare the request meanwhile (in process only:
    a remote router is called once the caller is admitted)."""

    def generate(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> AsyncGenerator[Event, None]: ...

    async def complete(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> tuple[Chunk, Done]: ...

    def chat(self, *, tenant: str = "", request_id: str = "", deadline: float | None = None) -> ChatChannel: ...

    async def list_models(self, *, deadline: float | None = None) -> list[ModelInfo]: ...

    async def embed(self, query: EmbedQuery, *, deadline: float | None = None) -> Embeddings: ...
