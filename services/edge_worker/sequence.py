"""One sequence of the batched edge engine (:mod:`services.edge_worker.batched`).

Its worker thread calls ``step()`` (or ``begin()`` then ``wait()``), which hands the sequence to the
engine's batch thread and blocks until that thread has fed its pending tokens and chosen the next
one. ``begin(ahead)`` lets the batch thread run the sequence's next steps on its own, round after
round, while the worker thread detokenizes and sends (a lone stream's rounds then never wait for a
thread to wake). Only the batch thread touches ``tokens``, ``kv_len``, ``slot`` and ``parked`` while
a step is pending.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams
from services.edge_worker.sampler import rng_for
from services.worker.grammar import TokenConstraint
from services.worker.penalties import Penalties, penalties_for
from services.worker.types import EngineInfo, StepInterrupted

READY_LIMIT = 2
"""Tokens a sequence's batch thread may have chosen and not yet handed to :meth:`BatchedSequence.wait`
before it stops running that sequence ahead (the consumer fell behind: its next ``wait`` resumes it)."""


class BatchRunner(Protocol):
    """What a sequence needs of the engine whose batch thread runs it
    (:class:`services.edge_worker.batched.BatchedEngine`)."""

    @property
    def info(self) -> EngineInfo: ...

    def submit(self, seq: BatchedSequence) -> None:
        """Queue ``seq`` for the batch thread, which hands it its next token or an error (``seq.deliver``)."""

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
        self._cond = threading.Condition()
        """Guards the hand-over below (the batch thread delivers, the worker thread waits)."""
        self._ready: deque[tuple[int | BaseException, SampledLogprobs | None]] = deque()
        """Results the batch thread handed over and :meth:`wait` has not returned yet, oldest first."""
        self._handed = 0
        """Results handed over so far."""
        self._owed = 1 if source is not None else 0
        """Steps begun whose result is not handed over yet (a fork's first comes with its copy)."""
        self._ahead = 0
        """Steps the batch thread may still begin on its own (:meth:`begin`'s ``ahead``)."""
        self._stalled = False
        """The batch thread did not begin a step it could have because ``READY_LIMIT`` results waited
        unread: :meth:`wait` begins it."""
        self.next_logprobs: SampledLogprobs | None = None
        """Set by the batch thread right before it hands a token over: that token's logprobs."""
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

    def begin(self, ahead: int = 0) -> None:
        """Hand the next step to the batch thread and return at once; :meth:`wait` returns its token.

        ``ahead``: after that step the batch thread may begin up to this many more on its own, each in
        the round after the previous token was chosen (no wait for this thread), as long as fewer than
        ``READY_LIMIT`` tokens wait unread and the last was not EOS; each :meth:`wait` returns the
        next. The runner begins a turn's whole budget at once, so a stream's rounds never wait for it
        to detokenize and send. Closing the sequence drops what was begun; :meth:`reuse` waits for it."""
        if self.closed:
            raise RuntimeError("sequence is closed")
        with self._cond:
            submit = self.source is None  # a fork's first token comes with its copy of the source's KV
            if submit and self._owed:
                raise RuntimeError("a step is already begun: wait for it first")
            self._ahead = max(0, ahead)
            self._owed += submit
        if submit:
            self._engine.submit(self)

    def wait(self) -> int:
        """The result of the oldest step begun and not waited for (blocks until the batch thread has it)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._ready))
            result, self.last_logprobs = self._ready.popleft()
            resume = self._stalled and not self.closed
            self._stalled = False
            self._owed += resume
        self.source = None
        if resume:
            self._engine.submit(self)
        if isinstance(result, BaseException):
            raise result
        return result

    def finish(self, result: int | BaseException) -> None:
        """Hand ``result`` (a token, or the step's error) over to :meth:`wait` (the batch thread)."""
        self.deliver(result, frozenset())

    def deliver(self, result: int | BaseException, eos: frozenset[int]) -> bool:
        """Hand ``result`` over (the batch thread) and say whether the batch thread begins this
        sequence's next step itself (:meth:`begin`'s ``ahead``): the result is a token not in ``eos``,
        steps are left, the sequence is open, and fewer than ``READY_LIMIT`` results wait unread."""
        failed = isinstance(result, BaseException)
        with self._cond:
            self._ready.append((result, None if failed else self.next_logprobs))
            self.next_logprobs = None
            self._handed += 1
            self._owed = max(0, self._owed - 1)
            more = self._ahead > 0 and not failed and result not in eos and not (self.closed or self.interrupted)
            if more:
                self._ahead -= 1
                if len(self._ready) >= READY_LIMIT:  # the consumer fell behind: its next ``wait`` begins it
                    self._stalled, more = True, False
            self._owed += more
            self._cond.notify_all()
        return more

    def settle(self) -> None:
        """Begin no more steps and wait until those begun are done (their results are dropped): then
        only this thread touches the sequence. Blocks up to one model call."""
        with self._cond:
            self._ahead = 0
            self._stalled = False
            self._cond.wait_for(lambda: self._owed == 0)
            self._ready.clear()

    @property
    def forked(self) -> bool:
        """A fork's first token is ready (or its fork failed): ``step`` returns at once."""
        with self._cond:
            return self._handed > 0

    def reuse(self, token_ids: Sequence[int], sampling: SamplingParams) -> bool:
        """Prepare the next turn over ``token_ids``; False if this sequence cannot be reused. Steps the
        last turn began and did not wait for are let finish first (their KV is past the turn's end:
        only the common prefix below is kept)."""
        key = _reusable_key(sampling)
        if self.closed or key is None or key != self._key:
            return False
        self.settle()
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
        if self.source is not None and not self.forked:  # a fork not made yet: it never will be
            self.finish(StepInterrupted("the turn was cancelled"))
        self._engine.wake()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._engine.release(self)
