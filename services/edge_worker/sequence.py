"""One sequence of the batched edge engine (:mod:`services.edge_worker.batched`).

Its worker thread calls ``step()`` (or ``begin()`` then ``wait()``), which hands the sequence to the
engine's batch thread and blocks until that thread has fed its pending tokens and chosen the next
one. Only the batch thread touches ``tokens``, ``kv_len``, ``slot`` and ``parked`` while a step is
pending.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams
from services.edge_worker.sampler import rng_for
from services.worker.grammar import TokenConstraint
from services.worker.penalties import Penalties, penalties_for
from services.worker.types import EngineInfo, StepInterrupted


class BatchRunner(Protocol):
    """What a sequence needs of the engine whose batch thread runs it
    (:class:`services.edge_worker.batched.BatchedEngine`)."""

    @property
    def info(self) -> EngineInfo: ...

    def submit(self, seq: BatchedSequence) -> None:
        """Queue ``seq`` for the batch thread, which calls ``seq.finish`` with its next token or an error."""

    def wake(self) -> None:
        """Make the batch thread look at its sequences again (``seq.interrupted`` was set)."""

    def release(self, seq: BatchedSequence) -> None:
        """Give ``seq``'s slot back (it is closed)."""


def _reusable_key(sampling: SamplingParams) -> tuple[Any, ...] | None:
    """Turns with equal keys may share a sequence; None (an explicit seed, a structured-output
    constraint: its grammar state starts with the turn) never shares one."""
    if sampling.structured is not None:
        return None
    if sampling.greedy:
        return ("greedy",)
    if sampling.seed is not None:
        return None  # a seeded turn must reproduce what a fresh sequence gives (the response cache relies on it)
    return ("sample", sampling.temperature, sampling.top_p, sampling.top_k)


class BatchedSequence:
    """One generation; ``step`` blocks until the batch thread produced its next token."""

    def __init__(
        self,
        engine: BatchRunner,
        tokens: Sequence[int],
        sampling: SamplingParams,
        prefill_end: int,
        constraint: TokenConstraint | None = None,
        source: BatchedSequence | None = None,
    ) -> None:
        self._engine = engine
        self.source = source
        """A fork's source until its first step returned: that step waits for the batch thread to
        copy the source's prompt KV into this sequence's slot and sample its first token from the
        source's prefill logits (``BatchedEngine.start_n``); it never runs the prompt itself."""
        self.forks: list[BatchedSequence] = []
        """Forks waiting for this sequence's prefill (the other choices of an n-choice request)."""
        self.tokens = list(tokens)
        """Every token of the sequence; KV exists for the first ``kv_len``."""
        self.kv_len = 0
        self.prefill_end = prefill_end
        """Tokens before this index are prefilled in chunks; later ones (replay) one decode row each."""
        self.sampling = sampling
        self.rng = rng_for(sampling)
        self.penalties = self._penalties(sampling, prefill_end)
        """Its penalties over the prompt and the tokens generated so far (None: none asked for)."""
        self.constraint = constraint
        """Its structured-output grammar state, already advanced over replayed tokens (None: unconstrained)."""
        self._key = _reusable_key(sampling)
        self.slot: int | None = None
        self.parked: list[np.ndarray] | None = None
        self.closed = False
        self.interrupted = False
        """Set by ``interrupt``: the batch thread ends the pending step before its next model call."""
        self.background = False
        """Background work (a batch line): sits out any round that prefills a sequence not marked so."""
        self.last_used = 0.0
        self._done = threading.Event()
        self._result: int | BaseException | None = None
        self.prefill_tokens = len(self.tokens)
        """Tokens the next ``step`` computes before its token (the context, or a chat turn's new part)."""
        self.last_logprobs: SampledLogprobs | None = None
        """With ``sampling.logprobs``: the token ``step`` returned last, its logprob and top alternatives (set
        by the batch thread before it hands the token over)."""

    def _penalties(self, sampling: SamplingParams, prompt_len: int) -> Penalties | None:
        penalties = penalties_for(sampling, self.tokens[:prompt_len], self._engine.info.eos_token_ids)
        if penalties is not None:
            for token in self.tokens[prompt_len:]:  # a resumed stream's replayed tokens were generated
                penalties.record(token)
        return penalties

    def step(self) -> int:
        self.begin()
        return self.wait()

    def begin(self) -> None:
        """Hand the next step to the batch thread and return at once; :meth:`wait` returns its token.
        The runner begins the next step as soon as it has a token and detokenizes and sends that token
        while the model runs (the batch thread's rounds need not wait for it)."""
        if self.closed:
            raise RuntimeError("sequence is closed")
        if self.source is None:  # a fork's first token comes with its copy of the source's KV: nothing to submit
            self._done.clear()
            self._engine.submit(self)

    def wait(self) -> int:
        """The token of the step :meth:`begin` started (blocks until the batch thread has it)."""
        self._done.wait()
        self.source = None
        result = self._result
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        return result

    def finish(self, result: int | BaseException) -> None:
        self._result = result
        self._done.set()

    @property
    def forked(self) -> bool:
        """A fork's first token is ready (or its fork failed): ``step`` returns at once."""
        return self._done.is_set()

    def reuse(self, token_ids: Sequence[int], sampling: SamplingParams) -> bool:
        """Prepare the next turn over ``token_ids``; False if this sequence cannot be reused."""
        key = _reusable_key(sampling)
        if self.closed or key is None or key != self._key:
            return False
        if len(token_ids) + sampling.max_tokens > self._engine.info.context_length:
            return False
        common = 0
        limit = min(self.kv_len, len(token_ids) - 1)  # at least one token must run to get logits
        while common < limit and self.tokens[common] == token_ids[common]:
            common += 1
        if common == 0:
            return False
        self.tokens = list(token_ids)
        self.kv_len = common
        self.prefill_end = len(self.tokens)
        self.sampling = sampling
        self.penalties = self._penalties(sampling, len(self.tokens))
        self.prefill_tokens = len(self.tokens) - common
        return True

    def interrupt(self) -> None:
        """End the pending (or next) step with StepInterrupted once the model call in progress, at
        most one prefill chunk, is done. Any thread; waits for no model call."""
        self.interrupted = True
        if self.source is not None and not self._done.is_set():  # a fork not made yet: it never will be
            self.finish(StepInterrupted("the turn was cancelled"))
        self._engine.wake()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._engine.release(self)
