"""Transport-free types shared by the worker runtime and the engines (no grpc, no protobuf), and the
check of a prompt against the loaded model (:func:`validate_prompt`).

An :class:`Engine` owns one loaded model. ``Engine.start`` creates an :class:`EngineSequence` that
produces one token per ``step()``; both are called only from worker threads, never from the event
loop. Everything else (admission, detokenization, stop strings, counters) is engine-independent.

Optional engine methods are found by duck typing (like ``start_chat``). For n choices, called from a
worker thread:

* ``start_n(token_ids, sampling, n) -> list[EngineSequence]``: the ``n`` choices of one request
  (``sampling.n`` is n; choice ``i`` samples with ``sampling.choice(i)``) over one prefill of
  ``token_ids``: the sequences share the prompt's KV (copied or referenced) instead of prefilling it
  n times. Each sequence is then stepped by its own thread like any other. Without it the runtime
  starts n independent sequences (:func:`services.worker.runner.start_choices`). It may raise
  InvalidArgument when n sequences of ``sampling.max_tokens`` cannot fit the engine's KV at once.

Optional engine method for background work (batch lines), called from the event loop (it must not
wait for the model):

* ``hold_background(until: float)``: the host's foreground flag from the routers
  (``MuxRequest.background_hold``, services/worker/mux.py): background sequences sit out the engine's
  steps until ``time.monotonic()`` reaches ``until`` (0: now). Engines without background sequences
  (the cloud engine) have none, and the flag is ignored.

Optional engine methods that feed the load report (``services.worker.report``); both are called
from a thread, never from the event loop, so they may take the engine's locks but must be quick:

* ``kv_usage() -> KVUsage``: KV bytes held and the engine's budget (for the router's admission).
* ``hot_prefix_blocks(block_tokens: int) -> Sequence[bytes]``: block hashes, in the
  ``services.store.keys.kv_block_hashes`` scheme at ``block_tokens`` per block, of prefixes whose KV
  the engine can reuse for a *new* request (a cross-request prefix cache); each chain from its first
  block, most recently used first. The scope (tenant, shareable) of the request being run on the
  calling thread is :func:`services.worker.runner.current_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from services.common.errors import InvalidArgument
from services.common.logprobs import TokenLogprob
from services.common.sampling import SamplingParams


class FinishReason(StrEnum):
    """Why a generation ended (mirrors ``meshserve.v1.FinishReason``)."""

    STOP = "stop"
    LENGTH = "length"
    STOP_STRING = "stop_string"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationRequest:
    """One turn to run: the full context and how to sample its continuation."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    resume_ids: tuple[int, ...] = ()
    """Tokens an earlier worker already sent; prefilled after the prompt, never re-sent."""
    request_id: str = ""
    tenant: str = ""
    """Tenant of the request: the salt of its KV block hashes unless ``shareable``."""
    shareable: bool = False
    """The request marked its prefix shareable across tenants (KV block hashes use the shared salt)."""
    priority: int = 0
    """Priority class from the router, 0 (default) to 9: engines that queue serve higher classes first."""
    background: bool = False
    """Background work (a batch line): an engine whose sequences have a ``background`` attribute (the
    batched edge engine) leaves it out of any step that prefills a turn not marked so."""


@dataclass(frozen=True)
class TokenEvent:
    """Tokens produced since the previous event and the text they released (may be empty)."""

    token_ids: tuple[int, ...]
    text: str
    index: int = 0
    """The choice they belong to (0 to n-1 of ``SamplingParams.n``)."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """With ``sampling.logprobs``: one entry per token id, in order (empty otherwise)."""


@dataclass(frozen=True)
class FinalEvent:
    """End of a turn, or with n > 1 choices, of one choice (``index``): a turn of n choices ends after
    n of them. ``text`` is trailing text that was held back (stop-string prefix, partial UTF-8)."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prefill_tokens: int
    text: str = ""
    index: int = 0


@dataclass(frozen=True)
class KVUsage:
    """KV memory an engine holds now (``Engine.kv_usage()``, optional)."""

    used_bytes: int
    """Bytes of KV held by live sequences, kept chats and any prefix cache."""
    budget_bytes: int = 0
    """The most KV bytes the engine will hold; 0 = no fixed budget."""


@dataclass(frozen=True)
class QueuedEvent:
    """The turn still waits for a generation slot or for its first token (sent as a keepalive, so
    callers can tell a queued or prefilling turn from a stalled worker)."""


QUEUED = QueuedEvent()


@dataclass(frozen=True)
class EngineInfo:
    """What the runtime needs to know about a loaded model."""

    model_id: str
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    build: str = ""
    """What decides this engine's numbers beyond the model (weight format, quantization, kernel
    choices), e.g. ``onnx-int4:edge-int4/batched/lm_head=int8/rows>=2``; the worker prefixes the model id
    and version and announces it (``WorkerStats.build``). Engines with equal builds give equal greedy tokens."""


def validate_prompt(prompt_ids: Sequence[int], info: EngineInfo) -> None:
    """Reject an empty prompt, a token id outside the vocabulary, or a prompt that fills the context
    (InvalidArgument, shown to the caller)."""
    if not prompt_ids:
        raise InvalidArgument("prompt_token_ids is empty; send at least one token id")
    bad = max(prompt_ids)
    if bad >= info.vocab_size:
        raise InvalidArgument(f"token id {bad} is out of range; model {info.model_id} has {info.vocab_size} tokens")
    if len(prompt_ids) >= info.context_length:
        raise InvalidArgument(
            f"the prompt has {len(prompt_ids)} tokens but the context holds {info.context_length}; shorten it"
        )


class Tokenizer(Protocol):
    """The part of ``tokenizers.Tokenizer`` the detokenizer uses."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class StepInterrupted(RuntimeError):
    """A step ended early by ``interrupt()``: the turn was cancelled during its prefill."""


class EngineSequence(Protocol):
    """One generating sequence. Not thread-safe: one thread at a time calls it.

    An engine may also give its sequences ``interrupt()``: callable from any thread (the event loop's
    included: it must not wait for the model), it makes the step in flight, or the next one, raise
    :class:`StepInterrupted` as soon as the model call in progress (one prefill chunk) has ended.
    The runner uses it for the first step only, whose prefill of a long context can take seconds;
    the sequence is closed afterwards.

    An engine may also give its sequences ``begin(ahead)`` and ``wait()``, ``step`` in two halves:
    ``begin`` starts the next step and returns at once, and lets the engine start up to ``ahead``
    more on its own, one after another (stopping at EOS); each ``wait`` returns the next token. After
    the first token, when the turn goes on (not EOS, tokens left), the runner begins the rest of its
    budget at once and then only waits, detokenizing and sending each token while the model runs; a
    turn ended by a stop string or a cancel meanwhile closes the sequence with steps pending. A chat
    session's sequence too: the engine's ``reuse`` must first wait for the steps begun.

    A sequence whose sampling asks for ``logprobs`` sets ``last_logprobs``
    (:class:`~services.common.logprobs.SampledLogprobs`) in every ``step`` to the token it returns;
    an engine that cannot refuses such turns in ``check_sampling``.
    """

    def step(self) -> int:
        """Run the model once (the first call prefills the context) and return the next token id."""
        ...

    def close(self) -> None:
        """Free the sequence's KV memory. Safe to call more than once."""
        ...


class Engine(Protocol):
    """A loaded model that can run several sequences, each from its own thread."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def start(self, token_ids: Sequence[int], sampling: SamplingParams, replay: Sequence[int] = ()) -> EngineSequence:
        """A new sequence over ``token_ids`` (nothing runs until the first ``step``).

        ``replay``: tokens another worker already generated after ``token_ids`` (a resumed stream).
        They are fed one forward pass each, as they were when decoded, so the continuation is
        bit-for-bit the one an undisturbed run would have produced (a single prefill pass over them
        computes slightly different numbers, which flips greedy choices at near-ties).
        """
        ...
