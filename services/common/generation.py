"""A turn of generation as it crosses the mesh: the one request type, the one event type, the one
finish reason, from the router's stream transport down to the engine and back.

The router's core starts a turn with a :class:`GenerationRequest`; the stream transport carries it
to the worker as a ``WorkerStart`` (converted once on each side), the worker's runtime runs it on its
engine and streams :class:`GenerationEvent` s back the same way: tokens and their text per choice,
keepalives while the turn is queued or prefilling, and for each choice one event with its
:class:`Final`. No transport here (no grpc, no protobuf).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from services.common.logprobs import TokenLogprob
from services.common.sampling import SamplingParams


class FinishReason(IntEnum):
    """Why generation stopped (the numbers of ``meshserve.v1.FinishReason``)."""

    UNSPECIFIED = 0
    STOP = 1
    """The model ended its answer (EOS)."""
    LENGTH = 2
    """``max_tokens`` (or the context) ran out."""
    STOP_STRING = 3
    """A stop string appeared; the text ends before it."""
    CANCELLED = 4
    """The caller (or the router) cancelled the turn."""
    TOOL_CALLS = 5
    """The answer is tool calls (set by the router, which parses them; a worker never sends it)."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One turn to run on a worker: the whole context and how to sample its continuation."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    resume_ids: tuple[int, ...] = ()
    """Tokens an earlier worker already sent after the prompt (a resumed stream): prefilled after it,
    one forward pass each, never sent again; ``sampling.max_tokens`` counts them."""
    request_id: str = ""
    tenant: str = ""
    """Tenant of the request: the salt of its KV block hashes unless ``shareable``."""
    shareable: bool = False
    """The request marked its prefix shareable across tenants (KV block hashes use the shared salt)."""
    priority: int = 0
    """Priority class from the router, 0 (default) to 9: engines that queue serve higher classes first."""
    background: bool = False
    """Background work (a batch line): an engine that yields (``EngineCapabilities.background``) leaves
    it out of any step that prefills a turn not marked so."""

    @property
    def context(self) -> tuple[int, ...]:
        """Prompt and resumed tokens: what the model has seen before the turn's first new token."""
        return self.prompt_ids + self.resume_ids


@dataclass(frozen=True, slots=True)
class Final:
    """How one choice of a turn ended."""

    reason: FinishReason
    prompt_tokens: int
    """The context's tokens (prompt and resumed tokens)."""
    completion_tokens: int
    """Tokens generated in this turn (an EOS counts; resumed tokens do not)."""
    prefill_tokens: int
    """Tokens the model ran before the first new token (less than the context where KV was reused)."""
    budget_closed: bool = False
    """Structured output: the mask closed the answer validly because ``max_tokens`` was about to run out
    (services/worker/grammar.py, ``TokenConstraint.budget_closed``; the caller's usage details say so)."""


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """What a turn streams, per choice: tokens and the text they released since the previous event
    (either may be empty), then one event with ``final`` set (its ``text`` is what was held back: a
    stop string's possible start, a partial UTF-8 character). ``queued`` events carry nothing: the
    turn still waits for a slot or for its first token (keepalives, so a caller can tell a queued or
    prefilling turn from a stalled worker). A turn of n choices ends after its n-th final."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    index: int = 0
    """The choice (0 to n-1 of ``SamplingParams.n``)."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """With ``sampling.logprobs``: one entry per token id, in order (empty otherwise)."""
    final: Final | None = None
    queued: bool = False
    sequence: int = 0
    """The frame's number in its turn on the wire, from 0 (stamped by the side that writes frames and
    read back by the side that reads them; a keepalive has none)."""


QUEUED = GenerationEvent(queued=True)
"""The keepalive event."""
