"""Runs turns on an engine: admission, the turn's sequences on the engine loop, its events.

The event loop never runs model code and no thread is started per sequence: an admitted turn's
sequences (n of them for n choices) go to the engine loop (:mod:`services.worker.loop`) in one
command, the loop's outputs come back through the :class:`~services.worker.outputs.OutputProcessor`,
and the turn's reader takes its events from its :class:`~services.worker.outputs.TurnStream`.
Cancellation ends the turn at once (its final says CANCELLED) and stops its sequences in the engine
before the next step, which frees their KV; a prefill in progress stops after its current chunk.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import structlog

from services.common import tracing
from services.common.coalesce import FlushWindow
from services.common.generation import QUEUED, Final, FinishReason, GenerationEvent, GenerationRequest
from services.common.sampling import SamplingParams
from services.worker.detokenizer import Detokenizers
from services.worker.loop import EngineLoop
from services.worker.outputs import ChoiceState, OutputProcessor, TurnStream
from services.worker.sessions import ChatSession, ChatSessions, HeldPrefix
from services.worker.sleep import ModelSleep
from services.worker.slots import Admission
from services.worker.stats import WorkerCounters
from services.worker.stops import StopStringMatcher
from services.worker.token_texts import TokenTexts
from services.worker.types import Engine, NewSequence, SequenceOutput

if TYPE_CHECKING:
    from services.worker.grammar import GrammarCompiler, TokenConstraint

log = structlog.get_logger(__name__)


class Turn:
    """One generation in flight. Iterate :meth:`events` once; :meth:`cancel` may be called any time."""

    def __init__(self, runner: Runner, request: GenerationRequest, session: ChatSession | None = None) -> None:
        self._runner = runner
        self.request = request
        self.session = session
        self._cancelled = asyncio.Event()
        self._stream = TurnStream()
        self._slots = 0
        """Admission slots held by its choices still running."""

    def cancel(self) -> None:
        """End the turn now: queued, it never runs; running, each choice ends CANCELLED."""
        self._cancelled.set()
        for st in self._stream.choices:
            self._runner.processor.cancel(st)

    async def _admit(self, count: int) -> AsyncGenerator[GenerationEvent | bool, None]:
        """Take ``count`` generation slots: keepalives while queued, then whether it was admitted."""
        runner = self._runner
        admitted = runner.admission.try_acquire(count)
        if not admitted:
            acquire = asyncio.ensure_future(runner.admission.acquire(self._cancelled, count))
            try:
                while not (await asyncio.wait({acquire}, timeout=runner.keepalive_s))[0]:
                    yield QUEUED
            except (asyncio.CancelledError, GeneratorExit):
                # Closed or cancelled while it waited (a caller's abort): it never ran.
                runner.counters.sequence_cancelled()
                if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
                    if acquire.result():  # the slots came as the caller left: pass them on
                        runner.admission.release(count)
                raise
            finally:
                if not acquire.done():
                    acquire.cancel()  # acquire() gives the slots up (or passes them on)
            admitted = acquire.result()
        yield admitted

    async def events(self) -> AsyncGenerator[GenerationEvent, None]:
        """The turn's events (:class:`~services.common.generation.GenerationEvent`): per choice its
        tokens as they come, then its final; the turn ends after the n-th final.

        While the turn waits for a slot, and then until its first token (the prefill of a long or
        resumed context), a keepalive comes every ``keepalive_s`` seconds: the caller can tell a
        working worker from a stalled one. Token events of one choice keep their order; choices
        interleave. Raises ResourceExhausted if the queue is full, and a sequence's failure.
        Closing the iterator early cancels the turn.
        """
        runner = self._runner
        request = self.request
        n = request.sampling.n
        budget = max(0, request.sampling.max_tokens - len(request.resume_ids))
        try:
            runner.admission.ensure_room()
            runner.counters.sequence_started()
            if not runner.model.enter(self):  # asleep: the shared wake, then this turn runs
                with tracing.span("worker.wake_wait"):
                    async with aclosing(self._wake()) as waking:
                        async for queued in waking:
                            yield queued
                if self._cancelled.is_set():  # cancelled while the model woke: it never ran
                    runner.counters.sequence_cancelled()
                    context = len(request.prompt_ids) + len(request.resume_ids)
                    for i in range(n):
                        yield GenerationEvent(index=i, final=Final(FinishReason.CANCELLED, context, 0, 0))
                    return
            with tracing.span("worker.queue_wait"):
                admitted = False
                async with aclosing(self._admit(n)) as admit:  # closed with us: a queued wait ends at once
                    async for item in admit:
                        if isinstance(item, GenerationEvent):
                            yield item
                        else:
                            admitted = item
            context = len(request.prompt_ids) + len(request.resume_ids)
            if not admitted:
                runner.counters.sequence_cancelled()
                for i in range(n):
                    yield GenerationEvent(index=i, final=Final(FinishReason.CANCELLED, context, 0, 0))
                return
            self._slots = n
            if budget == 0:  # a resumed stream whose every token was sent already
                self._release(n)
                yield GenerationEvent(final=Final(FinishReason.LENGTH, context, 0, 0))
                return
            # Phases (spans): prefill = admitted -> first token on the loop; first_token = until its
            # frame was taken; stream_end = the rest of the stream until the final was taken.
            phase = tracing.start_span("worker.prefill")
            try:
                seqs = await runner.sequences(request, budget, self.session)
            except BaseException:
                phase.end()
                self._release(self._slots)
                raise
            for i, seq in enumerate(seqs):
                runner.processor.open(runner.choice_state(self, seq, i, budget))
            if self._cancelled.is_set():  # cancelled while its grammar compiled
                self.cancel()
            else:
                runner.loop.add(seqs)
            async with aclosing(self._read(n, phase)) as read:
                async for event in read:
                    yield event
        finally:
            self.cancel()
            runner.model.leave(self)

    async def _wake(self) -> AsyncGenerator[GenerationEvent, None]:
        """Wake the model (one load shared with every other caller) and enter it as a user: keepalives
        meanwhile. Raises the wake's error (no memory, a failed load); closed early, this caller left."""
        runner = self._runner
        model = runner.model
        model.waiting += 1  # busy from here to enter(): no Sleep(only_if_idle) slips in between
        try:
            while not model.enter(self):
                wake = asyncio.ensure_future(model.wake())
                cancelled = asyncio.ensure_future(self._cancelled.wait())
                try:
                    while not (await asyncio.wait({wake, cancelled}, timeout=runner.keepalive_s))[0]:
                        yield QUEUED
                finally:
                    for waiting in (wake, cancelled):
                        if not waiting.done():
                            waiting.cancel()  # this caller goes away; the load goes on for the others
                if self._cancelled.is_set():
                    if wake.done() and not wake.cancelled():
                        wake.exception()  # seen: nobody waits for this turn's answer any more
                    return
                wake.result()
        finally:
            model.waiting -= 1

    async def _read(self, n: int, phase: tracing.Span) -> AsyncGenerator[GenerationEvent, None]:
        runner = self._runner
        stream = self._stream
        flush = runner.flush
        finals = 0
        sent = 0
        if flush is not None:
            flush.active += 1  # an open stream of this process until its events end
        try:
            while finals < n:
                if sent == 0:  # the prefill (long, or prompt + replay of a resumed stream) sends nothing
                    while not await stream.wait(runner.keepalive_s):
                        yield QUEUED
                else:
                    await stream.wait()
                if stream.error is not None:
                    raise stream.error
                events = stream.take()
                if flush is not None and any(event.final is None for event in events):
                    runner.processor.flushed(stream)  # tokens out: the next ones wait for the window
                for event in events:
                    if sent == 0:
                        phase.end()
                        phase = tracing.start_span("worker.first_token")
                    elif sent == 1:
                        phase.end()
                        phase = tracing.start_span("worker.stream_end")
                    if event.final is not None:
                        finals += 1
                        if n == 1:
                            phase.set_attributes({"meshserve.completion_tokens": event.final.completion_tokens})
                    sent += 1
                    yield event
        finally:
            phase.end()
            if flush is not None:
                flush.active -= 1

    def _release(self, count: int) -> None:
        if count:
            self._slots -= count
            self._runner.admission.release(count)

    def ended(self, st: ChoiceState) -> None:
        """A choice ended (the processor's ``on_end``): its slot back, its chat KV kept or freed."""
        runner = self._runner
        self._release(1)
        final = st.final
        assert final is not None
        if final.reason is FinishReason.CANCELLED:
            runner.counters.sequence_cancelled()
        if st.hold:
            session = self.session
            if final.reason is FinishReason.CANCELLED or self._stream.error is not None or session is None:
                runner.loop.stop(st.id, False)  # it may be held in the engine: free it
            else:  # the last token's KV is computed by the next step, so it is not held yet
                prefix = self.request.context + tuple(st.generated[:-1])
                session.keep(st.id, HeldPrefix(prefix, self.request.tenant, self.request.shareable))
        if self._slots == 0:
            runner.running.discard(self)


class Runner:
    """Owns the engine loop, admission, chat sessions and counters of one worker."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_active: int,
        max_queue: int,
        name: str = "worker",
        max_open_chats: int = 16,
        chat_idle_timeout_s: float = 120.0,
        keepalive_s: float = 1.0,
        flush: FlushWindow | None = None,
        sleep_margin_bytes: int = 64 << 20,
    ) -> None:
        self.engine = engine
        self.capabilities = engine.capabilities
        # Spaces each stream's token frames while many streams are open (None or window 0: off).
        self.flush = flush if flush is not None and flush.enabled else None
        self.keepalive_s = keepalive_s
        self.counters = WorkerCounters()
        self.loop = EngineLoop(engine, self._deliver, name=f"{name}-engine")
        self.processor = OutputProcessor(engine.info.eos_token_ids, self.counters, self.loop.stop, self.flush)
        self.sessions = ChatSessions(max_open_chats if self.capabilities.chat else 0, chat_idle_timeout_s, self._free)
        self.admission = Admission(max_active, max_queue)
        self.model = ModelSleep(engine, self.loop, self.sessions, margin_bytes=sleep_margin_bytes)
        """Sleep and wake (services/worker/sleep.py): every turn is a user of the model while it runs."""
        self.running: set[Turn] = set()
        """Turns admitted and not ended (the load report reads their requests)."""
        self._ids = itertools.count(1)
        self._texts = TokenTexts(engine.tokenizer)
        self._detokenizers = Detokenizers(engine.tokenizer, self._texts)
        self._grammars: GrammarCompiler | None = None
        self._started = False

    def start(self) -> None:
        """Start the engine loop on the running event loop (idempotent)."""
        if not self._started:
            self._started = True
            self.loop.start(asyncio.get_running_loop())

    def _deliver(self, steps: list[list[SequenceOutput]]) -> None:
        self.processor.deliver(steps)

    def _free(self, seq_id: int) -> None:
        """A chat session let its held sequence go (evicted, idle, closed): free its KV."""
        try:
            self.loop.stop(seq_id, False)
        except RuntimeError:  # the loop is stopped: the engine goes with it
            pass

    def token_texts(self) -> TokenTexts:
        """The engine's token texts and bytes (logprobs frames, the byte-level detokenizer), kept per id."""
        return self._texts

    def turn(self, request: GenerationRequest, session: ChatSession | None = None) -> Turn:
        """A new turn; it counts as started once accepted (admitted or queued) by ``events()``.

        Turns of one stream share its ``session`` (KV kept between turns where the engine can).
        """
        self.start()
        self.sessions.sweep()
        return Turn(self, request, session)

    async def sequences(
        self, request: GenerationRequest, budget: int, session: ChatSession | None
    ) -> list[NewSequence]:
        """The engine sequences of a turn: one, or n choices (choice ``i`` samples with
        ``sampling.choice(i)``; forks of the first where the engine shares a prefill; no chat KV kept).
        A structured-output constraint is compiled here, off the event loop."""
        sampling = replace(request.sampling, max_tokens=max(budget, 1))
        n = sampling.n
        reuse = None
        if session is not None and n == 1 and (held := session.take()) is not None:
            if request.resume_ids:  # exact replay beats reusing a held chat KV
                self._free(held)
            else:
                reuse = held
        seqs: list[NewSequence] = []
        for i in range(n):
            choice = sampling.choice(i)
            seqs.append(
                NewSequence(
                    next(self._ids),
                    request.prompt_ids,
                    choice,
                    request.resume_ids,
                    await self._constraint(choice, request.resume_ids),
                    tenant=request.tenant,
                    shareable=request.shareable,
                    priority=request.priority,
                    background=request.background,
                    fork_of=seqs[0].id if i and self.capabilities.forks else None,
                    reuse=reuse,
                    hold=session is not None and n == 1 and self.capabilities.chat,
                )
            )
        return seqs

    async def _constraint(self, sampling: SamplingParams, replay: tuple[int, ...]) -> TokenConstraint | None:
        """The sequence's grammar state (None: unconstrained), compiled on the compiler's pool."""
        if sampling.structured is None:
            return None
        # max_tokens: the turn's whole budget (``sampling``'s is what is left after the replay)
        return await asyncio.to_thread(
            partial(self.grammars().open, max_tokens=sampling.max_tokens + len(replay)), sampling.structured, replay
        )

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this engine's vocabulary, made on first use."""
        if self._grammars is None:
            from services.worker.grammar import GrammarCompiler  # llguidance: loaded where constraints run

            info = self.engine.info
            self._grammars = GrammarCompiler(self.engine.tokenizer, info.vocab_size, info.eos_token_ids)  # type: ignore[arg-type]
        return self._grammars

    def choice_state(self, turn: Turn, seq: NewSequence, index: int, budget: int) -> ChoiceState:
        request = turn.request
        context = request.context
        sampling = request.sampling
        texts = self.token_texts() if sampling.logprobs else None
        self.running.add(turn)
        return ChoiceState(
            seq.id,
            turn._stream,
            index,
            self._detokenizers.new(context),
            StopStringMatcher(sampling.stop),
            texts,
            min_tokens=sampling.min_tokens - len(request.resume_ids),
            budget=budget,
            context_len=len(context),
            hold=seq.hold,
            on_end=turn.ended,
            prefill=len(context),
            constraint=seq.constraint,
        )

    async def sweep_sessions_forever(self) -> None:
        """Free idle chat sequences every few seconds (runs until cancelled)."""
        while True:
            await asyncio.sleep(max(0.5, min(self.sessions.idle_timeout_s / 4, 5.0)))
            self.sessions.sweep()

    async def warmup(self) -> None:
        """A tiny greedy generation through the engine, so the first request does not pay for lazy
        init; it is not traffic: the counters start from zero afterwards."""
        turn = self.turn(GenerationRequest((0,), SamplingParams(max_tokens=2)))
        async for _ in turn.events():
            pass
        self.counters.reset()

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Cancel every running turn and stop the engine loop (after the step in flight)."""
        for turn in list(self.running):
            turn.cancel()
        if self._started:
            await asyncio.to_thread(self.loop.close, timeout_s)
        if self._grammars is not None:
            self._grammars.close()
