"""The engine core contract both tiers implement, and the checks the runtime makes against it (no
grpc, no protobuf).

An :class:`Engine` holds the set of live sequences of one loaded model. The worker runtime never
waits for it: from the event loop it hands commands (:meth:`~Engine.add`, :meth:`~Engine.stop`) to
the engine's one loop thread (:mod:`services.worker.loop`), which applies them between steps and runs
:meth:`~Engine.step` back to back while there is work. A step advances every runnable sequence
(decode rows plus chunked prefill, as each engine plans) and returns the outputs of all of them at
once (:class:`SequenceOutput`); the loop hands the whole step to the event loop in one call, where
detokenization, stop strings and logprobs text run once over all rows (:mod:`services.worker.outputs`).

Every engine method is called from the loop thread only, except those marked *any thread* (the load
report, Worker.ImportKV/ExportKV/Embed and the background flag call them from elsewhere; they must
not wait for a step). What an engine can do is declared once in :class:`EngineCapabilities` and
checked when the worker starts and for every turn (:func:`check_sampling`), never probed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.generation import FinishReason
from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams

if TYPE_CHECKING:  # the grammar module needs llguidance; the contract only names its state type
    from services.worker.grammar import TokenConstraint


class Tokenizer(Protocol):
    """The part of ``tokenizers.Tokenizer`` the runtime uses."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


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


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, declared once (the runtime checks requests against it)."""

    name: str
    """The engine's name in messages (``batched``, ``og``, ``cloud``, ...)."""
    chat: bool = False
    """A sequence added with ``hold`` keeps its KV when it ends, until stopped; a later sequence added
    with ``reuse`` naming it extends that KV (the next chat turn prefills only its new tokens)."""
    forks: bool = False
    """n choices of one prompt share one prefill (``NewSequence.fork_of``); without it each choice
    prefills the prompt itself."""
    logprobs: bool = False
    structured: bool = False
    """Applies a structured-output constraint's token mask (``NewSequence.constraint``)."""
    penalties: bool = False
    """Applies ``frequency_penalty``, ``presence_penalty``, ``logit_bias`` and ``min_tokens``."""
    background: bool = False
    """Honours ``NewSequence.background`` (batch lines sit out steps that prefill foreground work) and
    the host's foreground flag (:meth:`Engine.hold_background`)."""
    kv_transfer: bool = False
    """Worker.ImportKV / ExportKV: :meth:`Engine.import_kv` / :meth:`Engine.export_kv`."""
    embeddings: bool = False
    """Worker.Embed: :meth:`Engine.embed`."""
    sleeps: bool = False
    """Worker.Sleep / Wake: :meth:`Engine.release_model` gives the model's memory back (weights or graph
    session, KV) and :meth:`Engine.restore_model` loads it again (services/worker/sleep.py)."""
    load_processes: int = 1
    """Processes of this host that load the model alike on a wake (a tensor-parallel group's ranks,
    all on one host): the wake's memory check asks for what this process gave back, that many times."""
    refusal_hint: str = ""
    """Appended to a refusal of what it cannot do: where to send such a request instead."""


@dataclass(slots=True, eq=False)
class NewSequence:
    """One sequence for :meth:`Engine.add`: a turn's choice, with everything it needs already
    computed (its grammar compiled), so adding it never waits."""

    id: int
    """The runtime's id for it, unique in the worker's life."""
    prompt_ids: tuple[int, ...]
    """Prefilled (in chunks, or reused where KV exists) before its first token."""
    sampling: SamplingParams
    """This choice's sampling (``sampling.choice(i)``); ``max_tokens`` is the number of new tokens to
    generate at most (at least 1; resumed tokens are not counted)."""
    replay: tuple[int, ...] = ()
    """Tokens another worker already generated after the prompt (a resumed stream): fed one forward
    pass each, as they were when decoded, so the continuation is bit-for-bit the undisturbed run's (a
    single prefill pass over them computes slightly different numbers, which flips greedy choices at
    near-ties); never output again."""
    constraint: TokenConstraint | None = None
    """The structured-output grammar state, already advanced over ``replay`` (None: unconstrained)."""
    tenant: str = ""
    """The salt of its KV block keys unless ``shareable``."""
    shareable: bool = False
    priority: int = 0
    """0 to 9: engines that queue admit higher classes first."""
    background: bool = False
    """A batch line (``EngineCapabilities.background``)."""
    fork_of: int | None = None
    """Another sequence of the same prompt (``EngineCapabilities.forks``), added with it: this one is
    made from that one's prefill (its KV shared or copied, its first token sampled from the same
    logits with its own sampling) and never prefills the prompt. If that sequence stops before its
    prefill ended, this one ends CANCELLED."""
    reuse: int | None = None
    """A sequence held by an earlier turn of the same chat (``EngineCapabilities.chat``): the engine
    extends its KV over the longest common prefix, or stops it and starts afresh."""
    hold: bool = False
    """Keep the KV when the sequence ends, until :meth:`Engine.stop` (a chat turn)."""


@dataclass(slots=True)
class SequenceOutput:
    """What one step did for one sequence: new tokens, or its end, or its failure."""

    id: int
    tokens: list[int] = field(default_factory=list)
    """Tokens chosen in this step, in order (one per step, or several after a speculative round); an
    EOS ends the list (and the sequence)."""
    logprobs: list[SampledLogprobs] | None = None
    """With ``sampling.logprobs``: one per token of ``tokens``."""
    finish: FinishReason | None = None
    """Set when the sequence ended in this step: STOP (EOS), LENGTH (``max_tokens``) or CANCELLED (a
    fork whose source stopped before its prefill ended). It is then held (``hold``) or freed."""
    prefill_tokens: int | None = None
    """With its first token: the context tokens it ran through the model before it (fewer than the
    context where KV was reused)."""
    error: BaseException | None = None
    """The sequence failed (it is freed); a domain error is shown to the caller, any other is logged."""


class Engine(ABC):
    """A loaded model that steps every live sequence together (see the module docstring). Engines
    derive from it; what an engine without an ability does is here."""

    _wake: Callable[[], None] | None = None

    @property
    @abstractmethod
    def info(self) -> EngineInfo: ...

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @property
    @abstractmethod
    def capabilities(self) -> EngineCapabilities: ...

    @abstractmethod
    def add(self, seq: NewSequence) -> None:
        """Take a new sequence; it runs from the next step. Raises a domain error (the turn fails with
        it) when it can never fit (its KV, its choices)."""

    @abstractmethod
    def stop(self, seq_id: int, hold: bool = False) -> None:
        """End a live sequence (a stop string, a cancel) or free a held one: its KV is freed now, or with
        ``hold`` kept for a later ``reuse`` (``EngineCapabilities.chat``). Unknown ids are ignored."""

    @abstractmethod
    def step(self) -> list[SequenceOutput]:
        """Run the model once for every runnable sequence; the outputs of those that got a token, ended
        or failed (a prefill chunk that yields no token yet gives none). Never raises for one
        sequence's failure: that sequence's output carries it."""

    @abstractmethod
    def next_step_in(self) -> float | None:
        """When the next :meth:`step` has work: 0 now, a delay in seconds (only sequences held back
        until then, e.g. background work), or None (nothing until a command or a wake-up)."""

    def bind(self, wake: Callable[[], None]) -> None:
        """The loop thread's wake-up, for work that arrives inside the engine (a KV import, a Redis
        prefix load done): :meth:`wake` makes the loop ask :meth:`next_step_in` again. Called at start."""
        self._wake = wake

    def wake(self) -> None:
        """*Any thread.* Make the loop thread look again (before it is bound, nothing: it looks at start)."""
        if self._wake is not None:
            self._wake()

    def hold_background(self, until: float) -> None:
        """*Any thread.* The host's foreground flag (``EngineCapabilities.background``): background
        sequences sit out steps until ``time.monotonic()`` reaches ``until`` (0: now)."""
        return None

    def interrupt_background(self) -> None:
        """*Any thread.* Foreground work is being added: a step of background sequences only that is
        running now may stop part-way and run again later."""
        return None

    def kv_usage(self) -> KVUsage | None:
        """*Any thread*, quick. KV bytes held and the budget (the router's admission); None: not known."""
        return None

    def hot_prefix_blocks(self, block_tokens: int) -> Sequence[bytes]:
        """*Any thread*, quick. Block hashes, in the ``services.store.keys.kv_block_hashes`` scheme at
        ``block_tokens`` per block, of prefixes whose KV the engine can reuse for a *new* request (a
        cross-request prefix cache); each chain from its first block, most recently used first."""
        return ()

    def import_kv(self, prefix: KVPrefix) -> KVImport:
        """*Any thread*, blocking (``EngineCapabilities.kv_transfer``): Worker.ImportKV."""
        raise FailedPrecondition("this worker keeps no KV in the shared Redis prefix cache")

    def export_kv(self, prefix: KVPrefix) -> KVExport:
        """*Any thread*, blocking (``EngineCapabilities.kv_transfer``): Worker.ExportKV."""
        raise FailedPrecondition("this worker keeps no KV in the shared Redis prefix cache")

    def embed(self, inputs: Sequence[Sequence[int]], dimensions: int = 0) -> list[list[float]]:
        """*Any thread*, blocking (``EngineCapabilities.embeddings``): Worker.Embed."""
        raise FailedPrecondition("this worker does not serve embeddings")

    def release_model(self) -> None:
        """Give the model's memory back (``EngineCapabilities.sleeps``): weights or graph session, KV
        and everything sized by the model; the info, tokenizer and capabilities stay. Called on the
        loop thread (the loop steps nothing until :meth:`restore_model`), only with no live sequence (held
        chat sequences are freed first). Any-thread hooks (``kv_usage``, ``hot_prefix_blocks``) keep
        answering meanwhile (nothing held). FailedPrecondition on an engine that cannot."""
        raise FailedPrecondition(f"this worker's {self.capabilities.name} engine cannot release its model (sleep)")

    def restore_model(self) -> None:
        """Load the model again after :meth:`release_model` (loop thread), as it was at start: the same
        tokens for the same input. Raises ResourceExhausted when the host lacks the memory, Unavailable
        when the load fails (the engine stays released and a later call may try again)."""
        raise FailedPrecondition(f"this worker's {self.capabilities.name} engine cannot restore its model (wake)")

    def close(self) -> None:
        """Free the model; called once by its owner, after the loop thread stopped."""
        return None


@dataclass(frozen=True)
class KVUsage:
    """KV memory an engine holds now (:meth:`Engine.kv_usage`)."""

    used_bytes: int
    """Bytes of KV held by live sequences, kept chats and any prefix cache."""
    budget_bytes: int = 0
    """The most KV bytes the engine will hold; 0 = no fixed budget."""


@dataclass(frozen=True)
class KVPrefix:
    """A validated prompt prefix and the KV scope of its blocks."""

    token_ids: tuple[int, ...]
    tenant: str = ""
    """The tenant whose block keys are meant (the key salt unless ``shareable``)."""
    shareable: bool = False
    """The shared key namespace instead of the tenant's (services.store.keys.tenant_salt)."""


@dataclass(frozen=True)
class KVImport:
    """What an import did. ``held`` + ``imported`` leading blocks are held locally afterwards."""

    block_tokens: int
    prompt_tokens: int
    blocks: int
    """Full blocks of the prefix (a trailing partial block has no key)."""
    held: int
    """Leading blocks already held locally before the call."""
    imported: int
    """Blocks read from Redis and cached now."""
    redis_unavailable: bool = False
    """Redis could not be read (down, slow, breaker open): nothing came from it (the cache fails open)."""


@dataclass(frozen=True)
class KVExport:
    """What an export wrote to Redis (synchronously)."""

    block_tokens: int
    prompt_tokens: int
    blocks: int
    written: int
    """Leading blocks held locally that Redis stored (fewer than held: Redis refused the rest)."""
    not_held: int
    """Blocks from the first one not held locally to the end of the prefix (never written)."""


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


def check_sampling(caps: EngineCapabilities, sampling: SamplingParams) -> None:
    """Refuse (InvalidArgument) what the engine cannot apply, naming the field and where to go."""
    hint = f"; {caps.refusal_hint}" if caps.refusal_hint else ""
    if not caps.penalties and (
        sampling.frequency_penalty or sampling.presence_penalty or sampling.logit_bias or sampling.min_tokens
    ):
        raise InvalidArgument(
            f"this worker's {caps.name} engine applies no frequency_penalty, presence_penalty, logit_bias or "
            f"min_tokens; remove them{hint}"
        )
    if not caps.structured and sampling.structured is not None:
        raise InvalidArgument(
            f"this worker's {caps.name} engine cannot apply sampling.structured (response_format); send the "
            f"request without it{hint}"
        )
    if not caps.logprobs and sampling.logprobs:
        raise InvalidArgument(
            f"this worker's {caps.name} engine returns no logprobs; remove logprobs / top_logprobs{hint}"
        )
