"""Output processing: every step's outputs, all rows at once, turned into each turn's events.

:class:`OutputProcessor` runs on the event loop, once per hand-off of the engine loop
(:mod:`services.worker.loop`: one call for every step finished since the last): for each row it
detokenizes the new tokens incrementally, looks for stop strings (a match ends the sequence: the
engine is told to stop it before its next step), adds the logprobs' token texts, counts tokens and
prefills, and appends the result to the sequence's pending delta. Each turn's reader
(:class:`TurnStream`) is woken at most once per hand-off, however many of its tokens came; it then
takes one event per choice with everything pending.

**Flush window** (:class:`~services.common.coalesce.FlushWindow`, vLLM's stream interval made
adaptive): while the process is busy (at least ``busy_streams`` streams open), a stream that was
just given tokens is not woken for more until ``window_s`` has passed (one timer of the processor's
wakes every such stream when its time comes); the tokens that come meanwhile join the next frame. A
stream's first tokens, its final and its error are never held, and a lone stream (or any stream while
the process is not busy) is never held.

EOS ends a sequence with STOP and is neither sent nor detokenized (it counts as a completion token).
When a stop string matches, the token that completed it is still sent (its text is cut before the
stop string), as vLLM does. Before ``min_tokens`` (resumed tokens count) stop strings are not looked
for (the engine's sampler bans EOS meanwhile).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from services.common.coalesce import FlushWindow
from services.common.errors import MeshError
from services.common.generation import Final, FinishReason, GenerationEvent
from services.common.logprobs import TokenLogprob
from services.worker.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer
from services.worker.stats import WorkerCounters
from services.worker.stops import StopStringMatcher
from services.worker.token_texts import TokenTexts
from services.worker.types import SequenceOutput

if TYPE_CHECKING:  # the grammar module needs llguidance; this module only reads its state's flag
    from services.worker.grammar import TokenConstraint

log = structlog.get_logger(__name__)


@dataclass(slots=True, eq=False)
class ChoiceState:
    """One sequence's output state (a turn's choice), owned by the event loop."""

    id: int
    stream: TurnStream
    index: int
    detok: IncrementalDetokenizer | ByteLevelDetokenizer
    stops: StopStringMatcher
    texts: TokenTexts | None
    min_tokens: int
    """Tokens (this turn's) before which stop strings are not looked for."""
    budget: int
    context_len: int
    hold: bool
    """Its KV is kept for the chat's next turn when it ends (not cancelled)."""
    on_end: Callable[[ChoiceState], None]
    prefill: int = 0
    produced: int = 0
    generated: list[int] = field(default_factory=list)
    """Its tokens so far (kept only with ``hold``: the held prefix)."""
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: Final | None = None
    tail: str = ""
    flagged: bool = False
    """Listed in its stream's ``ready``."""
    constraint: TokenConstraint | None = None
    """Its structured-output grammar state (the engine loop's; read here once it ended: ``budget_closed``)."""


class TurnStream:
    """The events of one turn waiting for its reader (the stream's writer), and its wake-up."""

    __slots__ = ("choices", "error", "held", "next_at", "ready", "waiter")

    def __init__(self) -> None:
        self.ready: list[ChoiceState] = []
        self.waiter: asyncio.Future[None] | None = None
        self.next_at = 0.0
        """The flush window: tokens wake the reader from this time on (a final or an error at once)."""
        self.held = False
        """Listed in the processor's held streams (tokens wait for ``next_at``)."""
        self.error: BaseException | None = None
        self.choices: list[ChoiceState] = []

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, within: float | None = None) -> bool:
        """Until something is ready (True) or ``within`` seconds passed (False)."""
        if self.ready or self.error is not None:
            return True
        waiter = self.waiter = asyncio.get_running_loop().create_future()
        try:
            if within is None:
                await waiter
                return True
            done, _ = await asyncio.wait((waiter,), timeout=within)
            return bool(done)
        finally:
            self.waiter = None
            if not waiter.done():
                waiter.cancel()

    def take(self) -> list[GenerationEvent]:
        """Everything pending, one token event per choice (then its final, if it ended)."""
        events: list[GenerationEvent] = []
        for st in self.ready:
            st.flagged = False
            if st.ids or st.text:
                events.append(GenerationEvent(tuple(st.ids), st.text, st.index, tuple(st.logprobs)))
                st.ids = []
                st.text = ""
                if st.logprobs:
                    st.logprobs = []
            if st.final is not None:
                events.append(GenerationEvent(text=st.tail, index=st.index, final=st.final))
        self.ready = []
        return events


class OutputProcessor:
    """Turns step outputs into turn events (see the module docstring). Event loop only."""

    def __init__(
        self,
        eos: frozenset[int],
        counters: WorkerCounters,
        stop: Callable[[int, bool], None],
        flush: FlushWindow | None = None,
    ) -> None:
        self.eos = eos
        self.counters = counters
        self.flush = flush
        self._held: list[TurnStream] = []
        self._timer: asyncio.TimerHandle | None = None
        self._stop = stop
        """The engine loop's ``stop(seq_id, hold)``."""
        self.live: dict[int, ChoiceState] = {}

    def open(self, st: ChoiceState) -> None:
        self.live[st.id] = st
        st.stream.choices.append(st)

    def deliver(self, steps: list[list[SequenceOutput]]) -> None:
        """The outputs of one or more steps, oldest first (the engine loop's ``deliver``)."""
        live = self.live
        woken: list[TurnStream] = []
        urgent: list[TurnStream] = []
        tokens = 0
        for outputs in steps:
            for out in outputs:
                st = live.get(out.id)
                if st is None:
                    if out.id == -1 and out.error is not None:  # a whole step failed: every sequence with it
                        for each in list(live.values()):
                            self.fail(each, out.error)
                            urgent.append(each.stream)
                    continue  # ended meanwhile (cancelled, a stop string): its late rows are dropped
                if out.error is not None:
                    self.fail(st, out.error)
                    urgent.append(st.stream)
                    continue
                if out.prefill_tokens is not None:
                    st.prefill = out.prefill_tokens
                    self.counters.prefilled(out.prefill_tokens, st.context_len)
                if out.tokens:
                    tokens += len(out.tokens)
                    self._tokens(st, out)
                if st.final is None and (out.finish is not None or st.produced >= st.budget):
                    self.end(st, out.finish if out.finish is not None else FinishReason.LENGTH)
                    if out.finish is None:  # the engine did not end it itself: it does now
                        self._stop(st.id, st.hold)
                if not st.flagged:
                    st.flagged = True
                    st.stream.ready.append(st)
                    (urgent if st.final is not None else woken).append(st.stream)
                elif st.final is not None:
                    urgent.append(st.stream)
        if tokens:
            self.counters.token_generated(tokens)
        flush = self.flush
        if flush is not None and flush.busy and woken:
            now = flush.clock()
            for stream in woken:
                if stream.next_at > now:
                    if not stream.held:
                        stream.held = True
                        self._held.append(stream)
                else:
                    stream.wake()
            if self._held and self._timer is None:
                self._arm()
        else:
            for stream in woken:
                stream.wake()
        for stream in urgent:
            stream.wake()

    def flushed(self, stream: TurnStream) -> None:
        """The reader took a frame of tokens: the window starts (while the process is busy)."""
        flush = self.flush
        if flush is not None and flush.busy:
            stream.next_at = flush.clock() + flush.window_s

    def _arm(self) -> None:
        due = min(stream.next_at for stream in self._held)
        self._timer = asyncio.get_running_loop().call_at(due, self._release)

    def _release(self) -> None:
        """The timer: wake every held stream whose window has passed, then wait for the next one."""
        self._timer = None
        assert self.flush is not None
        now = self.flush.clock()
        keep = []
        for stream in self._held:
            if stream.next_at <= now or not stream.ready:
                stream.held = False
                stream.wake()
            else:
                keep.append(stream)
        self._held = keep
        if keep:
            self._arm()

    def _tokens(self, st: ChoiceState, out: SequenceOutput) -> None:
        eos = self.eos
        texts = st.texts
        for i, token in enumerate(out.tokens):
            st.produced += 1
            if token in eos:
                break  # the engine ends it with STOP; never sent nor detokenized
            if st.hold:
                st.generated.append(token)
            delta = st.detok.add(token)
            if st.produced <= st.min_tokens:  # the first min_tokens are never cut
                delta, stopped = st.stops.pass_through(delta), False
            else:
                delta, stopped = st.stops.feed(delta)
            st.ids.append(token)
            if delta:
                st.text += delta
            if texts is not None and out.logprobs is not None:
                st.logprobs.append(texts.entry(out.logprobs[i]))
            if stopped:
                self.end(st, FinishReason.STOP_STRING)
                self._stop(st.id, st.hold)
                return

    def end(self, st: ChoiceState, reason: FinishReason) -> None:
        """Finish ``st`` with ``reason`` (releases held text unless the end completes a stop string)."""
        if st.final is not None:
            return
        tail = ""
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            tail, stopped = st.stops.feed(st.detok.flush())
            if stopped:
                reason = FinishReason.STOP_STRING
            else:
                tail += st.stops.flush()
        st.tail = tail
        closed = st.constraint is not None and st.constraint.budget_closed
        st.final = Final(reason, st.context_len, st.produced, st.prefill if st.produced else 0, closed)
        self.live.pop(st.id, None)
        st.on_end(st)

    def cancel(self, st: ChoiceState) -> None:
        """End ``st`` now as CANCELLED and free it in the engine (a cancel, the reader gone)."""
        if st.final is None:
            self.end(st, FinishReason.CANCELLED)
            self._stop(st.id, False)
            if not st.flagged:
                st.flagged = True
                st.stream.ready.append(st)
            st.stream.wake()

    def fail(self, st: ChoiceState, error: BaseException) -> None:
        """``st`` failed: its turn raises ``error`` (a domain error is shown to the caller)."""
        if not isinstance(error, MeshError):
            log.error("sequence_failed", seq=st.id, exc_info=error)
        st.stream.error = error
        st.final = Final(FinishReason.CANCELLED, st.context_len, st.produced, 0)
        self.live.pop(st.id, None)
        self._stop(st.id, False)
        st.on_end(st)
