"""Runs turns on an engine: admission, one worker thread per generating sequence, event streaming.

The event loop never runs model code: each admitted sequence runs ``run_sequence`` in a thread of a
pool sized ``max_active`` and hands events to the loop through a :class:`Feed` (a loop wake-up only
while the stream's writer is waiting for one). Cancellation sets a flag the thread checks before
every decode step, so it stops within one step, and interrupts the first step (the prefill, which
may be seconds of chunks) where the engine can (``interrupt()``); the slot is freed when the thread
returns, whether or not anyone still reads the events.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import structlog

from services.common import tracing
from services.common.coalesce import FlushWindow
from services.common.sampling import SamplingParams
from services.worker.detokenizer import IncrementalDetokenizer
from services.worker.feed import Feed
from services.worker.interrupt import PrefillInterrupter
from services.worker.sessions import ChatSession, ChatSessions, HeldPrefix
from services.worker.slots import Admission
from services.worker.stats import WorkerCounters
from services.worker.stops import StopStringMatcher
from services.worker.token_texts import TokenTexts
from services.worker.types import (
    QUEUED,
    Engine,
    EngineSequence,
    FinalEvent,
    FinishReason,
    GenerationRequest,
    QueuedEvent,
    StepInterrupted,
    TokenEvent,
)

log = structlog.get_logger(__name__)
_local = threading.local()


def current_request() -> GenerationRequest | None:
    """The request the calling worker thread is running (for engines that salt KV by tenant)."""
    return getattr(_local, "request", None)


def open_sequence(
    engine: Engine,
    context: tuple[int, ...],
    sampling: SamplingParams,
    session: ChatSession | None,
    replay: tuple[int, ...] = (),
) -> tuple[EngineSequence, int]:
    """A sequence for this turn and how many tokens its first step prefills.

    With a session and an engine that supports chats (``start_chat``, and ``reuse`` on its
    sequences), the session's held sequence is reused when the engine can extend it.
    """
    if replay:  # a resumed stream: exact replay matters more than reusing a held chat sequence
        if session is not None and (previous := session.take()) is not None:
            previous.close()
        return engine.start(context[: len(context) - len(replay)], sampling, replay=replay), len(context)
    start_chat = getattr(engine, "start_chat", None)
    if session is None or start_chat is None:
        return engine.start(context, sampling), len(context)
    previous = session.take()
    if previous is not None:
        reuse = getattr(previous, "reuse", None)
        if reuse is not None and reuse(context, sampling):
            return previous, int(getattr(previous, "prefill_tokens", len(context)))
        previous.close()
    return start_chat(context, sampling), len(context)


def run_sequence(
    engine: Engine,
    request: GenerationRequest,
    stop_flag: threading.Event,
    emit: Callable[[TokenEvent], None],
    counters: WorkerCounters,
    session: ChatSession | None = None,
    interrupter: PrefillInterrupter | None = None,
    opened: EngineSequence | None = None,
    index: int = 0,
    texts: TokenTexts | None = None,
) -> FinalEvent:
    """Generate one turn (blocking; call from a worker thread). Returns the final event.

    EOS ends the turn with STOP and is neither sent nor detokenized (it counts as a completion
    token). When a stop string matches, the token that completed it is still sent (its text is
    cut before the stop string), as vLLM does. ``max_tokens`` covers resumed tokens too, and so does
    ``min_tokens``, before which stop strings are not looked for (the engine's sampler bans EOS).
    With a ``session`` the sequence is handed back to it afterwards (KV kept for the next turn),
    unless its prefill was interrupted by a cancel (``interrupter``): then it is closed.

    ``opened``: a sequence already started for this turn (choice ``index`` of an n-choice turn, from
    :func:`start_choices`); its events carry ``index``. With ``sampling.logprobs`` every token event
    carries the sequence's ``last_logprobs``, its token texts from ``texts`` (the runner's cache of them).
    """
    context = request.prompt_ids + request.resume_ids
    sampling = request.sampling
    budget = max(0, sampling.max_tokens - len(request.resume_ids))
    eos = engine.info.eos_token_ids
    detok = IncrementalDetokenizer(engine.tokenizer, context)
    stops = StopStringMatcher(sampling.stop)
    produced = 0
    reason = FinishReason.LENGTH
    _local.request = request
    if opened is not None:
        seq, prefill = opened, len(context)
    else:
        seq, prefill = open_sequence(
            engine, context, replace(sampling, max_tokens=max(budget, 1)), session, request.resume_ids
        )
    if hasattr(seq, "background"):  # set before its first step (a reused chat sequence too)
        seq.background = request.background
    failed = True
    generated: list[int] = []
    interrupt = getattr(seq, "interrupt", None) if interrupter is not None else None
    interrupted = False  # the sequence may carry the interrupt: never keep it for another turn
    if sampling.logprobs and texts is None:
        texts = TokenTexts(engine.tokenizer)
    # Split steps (``begin``/``wait``, EngineSequence): the next step starts before this token is
    # detokenized and sent (a chat session's sequence too: its ``reuse`` waits for steps begun).
    begin = getattr(seq, "begin", None)
    pending = False  # a step begun and not waited for yet
    pending_all = False  # the turn's remaining steps are begun (``begin(ahead)``)
    armed = False  # the interrupter is armed for the steps begun ahead
    try:
        while True:
            if stop_flag.is_set():
                reason = FinishReason.CANCELLED
                break
            if produced >= budget:
                reason = FinishReason.LENGTH
                break
            if pending:
                try:
                    token, pending = seq.wait(), False  # type: ignore[attr-defined]
                except StepInterrupted:  # a cancel ended the steps begun ahead
                    reason = FinishReason.CANCELLED
                    break
            elif produced == 0 and interrupt is not None and interrupter is not None:
                interrupter.arm(interrupt)
                try:
                    token = seq.step()
                except StepInterrupted:
                    reason = FinishReason.CANCELLED
                    break
                finally:
                    interrupter.disarm()
                    interrupted = interrupter.fired
            else:
                token = seq.step()
            if produced == 0:  # engines with a prefix cache know only now how much they prefilled
                prefill = int(getattr(seq, "prefill_tokens", prefill))
                counters.prefilled(prefill, len(context))
            produced += 1
            generated.append(token)
            counters.token_generated()
            if token in eos:
                reason = FinishReason.STOP
                break
            # the token's logprobs, read before the next step begins (it sets them anew)
            sampled: Any = seq.last_logprobs if texts is not None else None  # type: ignore[attr-defined]
            if begin is not None and produced < budget and not stop_flag.is_set():
                if not pending_all:  # the rest of the budget at once: the engine steps on its own from now
                    begin(budget - produced - 1)
                    pending_all = True
                    if interrupt is not None and interrupter is not None:
                        interrupter.arm(interrupt)  # a cancel ends them after the step in flight, not later
                        armed = True
                pending = True  # the next token is computed while this one is detokenized and sent
            if len(request.resume_ids) + produced <= sampling.min_tokens:  # the first min_tokens are never cut
                text, stopped = stops.pass_through(detok.add(token)), False
            else:
                text, stopped = stops.feed(detok.add(token))
            if texts is not None:
                emit(TokenEvent((token,), text, index=index, logprobs=(texts.entry(sampled),)))
            else:
                emit(TokenEvent((token,), text, index=index))
            if stopped:
                reason = FinishReason.STOP_STRING
                break
        failed = False
    finally:
        _local.request = None
        if armed and interrupter is not None:
            interrupter.disarm()  # no cancel reaches the sequence from now on: read whether one did
            interrupted = interrupted or bool(getattr(seq, "interrupted", False))
        # Only engines that can extend a held sequence (``start_chat``) keep it between turns; the
        # others (the cloud engine reuses prefixes through its own cache) free its KV now.
        if session is None or failed or interrupted or getattr(engine, "start_chat", None) is None:
            seq.close()
        else:  # the last token's KV is computed by the next step, so it is not held yet
            session.keep(seq, HeldPrefix(context + tuple(generated[:-1]), request.tenant, request.shareable))
    tail = ""
    if reason in (FinishReason.STOP, FinishReason.LENGTH):  # release held text, unless it completes a stop
        tail, stopped = stops.feed(detok.flush())
        if stopped:
            reason = FinishReason.STOP_STRING
        else:
            tail += stops.flush()
    return FinalEvent(
        reason=reason,
        prompt_tokens=len(context),
        completion_tokens=produced,
        prefill_tokens=prefill if produced else 0,
        text=tail,
        index=index,
    )


def start_choices(engine: Engine, request: GenerationRequest) -> list[EngineSequence]:
    """The ``sampling.n`` sequences of an n-choice turn (blocking: call from a worker thread).

    With the engine's ``start_n`` they share one prefill of the prompt; otherwise (an engine without
    it) each choice is an independent sequence that prefills the prompt itself. Choice ``i`` samples
    with ``sampling.choice(i)`` (its seed is ``seed + i``).
    """
    sampling = request.sampling
    n = sampling.n
    fitted = replace(sampling, max_tokens=max(sampling.max_tokens, 1))
    start_n = getattr(engine, "start_n", None)
    if start_n is not None:
        seqs: list[EngineSequence] = list(start_n(request.prompt_ids, fitted, n))
        assert len(seqs) == n, "start_n returned the wrong number of sequences"
        return seqs
    return [engine.start(request.prompt_ids, fitted.choice(i)) for i in range(n)]


def _coalesce(first: TokenEvent, queue: asyncio.Queue[TokenEvent | None] | Feed[TokenEvent | None]) -> TokenEvent:
    """``first`` merged with the token events already waiting in ``queue`` (token ids and texts
    concatenated in order), so a writer that fell behind the engine sends them as one frame.

    Never waits: it merges only what was already produced. The end marker (None) stays queued, so
    the final frame remains a frame of its own.
    """
    ids = list(first.token_ids)
    texts = [first.text]
    logprobs = list(first.logprobs)
    waiting = queue._queue  # type: ignore[union-attr]  # a peek; asyncio.Queue has no public one
    while waiting and waiting[0] is not None:
        event = queue.get_nowait()
        assert event is not None
        ids.extend(event.token_ids)
        texts.append(event.text)
        logprobs.extend(event.logprobs)
    return TokenEvent(tuple(ids), "".join(texts), logprobs=tuple(logprobs))


def _coalesce_choice(first: TokenEvent, queue: Feed[TokenEvent | FinalEvent | BaseException]) -> TokenEvent:
    """``first`` merged with the token events of the same choice waiting right behind it in ``queue``."""
    ids = list(first.token_ids)
    texts = [first.text]
    logprobs = list(first.logprobs)
    waiting = queue._queue  # type: ignore[attr-defined]  # a peek
    while waiting and isinstance(waiting[0], TokenEvent) and waiting[0].index == first.index:
        event = queue.get_nowait()
        assert isinstance(event, TokenEvent)
        ids.extend(event.token_ids)
        texts.append(event.text)
        logprobs.extend(event.logprobs)
    return TokenEvent(tuple(ids), "".join(texts), index=first.index, logprobs=tuple(logprobs))


class Turn:
    """One generation in flight. Iterate ``events()`` once; ``cancel()`` may be called any time."""

    def __init__(self, runner: Runner, request: GenerationRequest, session: ChatSession | None = None) -> None:
        self._runner = runner
        self.request = request
        self.session = session
        self._stop = threading.Event()
        self._cancelled = asyncio.Event()
        self._interrupter = PrefillInterrupter()
        # One per choice of an n-choice turn (each choice's first step is its own thread's).
        self._interrupters = [self._interrupter] + [PrefillInterrupter() for _ in range(request.sampling.n - 1)]

    def cancel(self) -> None:
        self._stop.set()
        self._cancelled.set()
        for interrupter in self._interrupters:
            interrupter.fire()

    async def _admit(self, count: int) -> AsyncGenerator[QueuedEvent | bool, None]:
        """Take ``count`` generation slots: keepalives while queued, then whether it was admitted."""
        runner = self._runner
        admitted = runner.admission.try_acquire(count)
        if not admitted:
            acquire = asyncio.ensure_future(runner.admission.acquire(self._cancelled, count))
            try:
                while not (await asyncio.wait({acquire}, timeout=runner.keepalive_s))[0]:
                    yield QUEUED
            except (asyncio.CancelledError, GeneratorExit):
                runner.counters.sequence_cancelled()
                if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
                    if acquire.result():  # the slots came as the caller left: pass them on
                        runner.admission.release(count)
                raise
            finally:
                if not acquire.done():
                    acquire.cancel()
            admitted = acquire.result()
        yield admitted

    async def _choices(self) -> AsyncGenerator[TokenEvent | FinalEvent | QueuedEvent, None]:
        """The events of an n-choice turn (``sampling.n`` > 1): see :meth:`events`.

        The turn takes n generation slots at once; the n sequences come from one
        :func:`start_choices` call (one prefill where the engine has ``start_n``), each runs in its
        own thread and frees its slot when it ends. Token events of one choice keep their order;
        choices interleave; each choice's FinalEvent comes after its last token event, and the
        turn's events end after the n-th. No chat KV is kept (the session's held sequence stays as it was).
        """
        runner = self._runner
        request = self.request
        n = request.sampling.n
        try:
            runner.admission.ensure_room()
            runner.counters.sequence_started()
            admitted = False
            with tracing.span("worker.queue_wait"):
                async with aclosing(self._admit(n)) as admit:  # closed with us: a queued wait ends at once
                    async for item in admit:
                        if isinstance(item, QueuedEvent):
                            yield item
                        else:
                            admitted = item
            if not admitted:
                runner.counters.sequence_cancelled()
                for i in range(n):
                    yield FinalEvent(FinishReason.CANCELLED, len(request.prompt_ids), 0, 0, index=i)
                return
            loop = asyncio.get_running_loop()
            queue: Feed[TokenEvent | FinalEvent | BaseException] = Feed(loop)

            def emit(event: TokenEvent | FinalEvent | BaseException) -> None:
                try:
                    queue.put(event)
                except RuntimeError:  # loop closed during shutdown: stop generating
                    self._stop.set()

            try:
                seqs = await loop.run_in_executor(runner.executor, start_choices, runner.engine, request)
            except BaseException:
                runner.admission.release(n)
                raise

            def work(index: int, seq: EngineSequence) -> FinalEvent:
                try:
                    final = run_sequence(
                        runner.engine,
                        request,
                        self._stop,
                        emit,  # type: ignore[arg-type]
                        runner.counters,
                        None,
                        self._interrupters[index],
                        opened=seq,
                        index=index,
                        texts=runner.token_texts() if request.sampling.logprobs else None,
                    )
                except BaseException as exc:
                    emit(exc)
                    raise
                emit(final)
                return final

            for index, seq in enumerate(seqs):
                future = loop.run_in_executor(runner.executor, work, index, seq)
                runner.running[future] = self
                future.add_done_callback(runner.sequence_done)  # frees this choice's slot
            ended = 0
            sent = 0
            while ended < n:
                if sent == 0:  # the shared prefill sends nothing: keepalives meanwhile
                    first = asyncio.ensure_future(queue.get())
                    try:
                        while not (await asyncio.wait({first}, timeout=runner.keepalive_s))[0]:
                            yield QUEUED
                    finally:
                        if not first.done():
                            first.cancel()
                    event = first.result()
                else:
                    event = await queue.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, FinalEvent):
                    ended += 1
                elif not queue.empty():
                    event = _coalesce_choice(event, queue)
                sent += 1
                yield event
        finally:
            self.cancel()

    async def events(self) -> AsyncGenerator[TokenEvent | FinalEvent | QueuedEvent, None]:
        """Token events as they are produced, then exactly one FinalEvent.

        While the turn waits for a slot, and then until its first token (the prefill of a long or
        resumed context), a QueuedEvent comes every ``keepalive_s`` seconds: the caller can tell a
        working worker from a stalled one.

        Raises ResourceExhausted if the queue is full. Closing the iterator early cancels the turn.
        """
        if self.request.sampling.n > 1:
            async with aclosing(self._choices()) as choices:
                async for item in choices:
                    yield item
            return
        runner = self._runner
        try:
            runner.admission.ensure_room()
            runner.counters.sequence_started()
            with tracing.span("worker.queue_wait"):
                admitted = runner.admission.try_acquire()
                if not admitted:
                    acquire = asyncio.ensure_future(runner.admission.acquire(self._cancelled))
                    try:
                        while not (await asyncio.wait({acquire}, timeout=runner.keepalive_s))[0]:
                            yield QUEUED
                    except (asyncio.CancelledError, GeneratorExit):
                        # Closed or cancelled while it waited (a caller's abort): it never ran.
                        runner.counters.sequence_cancelled()
                        if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
                            if acquire.result():  # the slot came as the caller left: pass it on
                                runner.admission.release()
                        raise
                    finally:
                        if not acquire.done():
                            acquire.cancel()  # acquire() gives the slot up (or passes it on)
                    admitted = acquire.result()
            if not admitted:
                runner.counters.sequence_cancelled()
                n = len(self.request.prompt_ids) + len(self.request.resume_ids)
                yield FinalEvent(FinishReason.CANCELLED, n, 0, 0)
                return
            loop = asyncio.get_running_loop()
            queue: Feed[TokenEvent | None] = Feed(loop)  # wakes the loop only while we wait in get()

            def emit(event: TokenEvent | None) -> None:
                try:
                    queue.put(event)
                except RuntimeError:  # loop closed during shutdown: stop generating
                    self._stop.set()

            def work() -> FinalEvent:
                try:
                    return run_sequence(
                        runner.engine,
                        self.request,
                        self._stop,
                        emit,
                        runner.counters,
                        self.session,
                        self._interrupter,
                        texts=runner.token_texts() if self.request.sampling.logprobs else None,
                    )
                finally:
                    emit(None)

            # Phases (spans): prefill = admitted -> first token on the loop; first_token = until its
            # frame was sent; stream_end = the rest of the stream until the final frame was sent.
            phase = tracing.start_span("worker.prefill")
            future = loop.run_in_executor(runner.executor, work)
            runner.running[future] = self
            future.add_done_callback(runner.sequence_done)
            flush = runner.flush
            last_sent: float | None = None
            if flush is not None:
                flush.active += 1  # an open stream of this process until its events end
            try:
                sent = 0
                while True:
                    if sent == 0:  # prefill (long, or prompt + replay of a resumed stream) sends nothing
                        first = asyncio.ensure_future(queue.get())
                        try:
                            while not (await asyncio.wait({first}, timeout=runner.keepalive_s))[0]:
                                yield QUEUED
                        finally:
                            if not first.done():
                                first.cancel()
                        event = first.result()
                    else:
                        event = await queue.get()
                    if event is None:
                        break
                    if not queue.empty():  # tokens that came while the last frame was written: one frame
                        event = _coalesce(event, queue)
                    if flush is not None:
                        # The flush window (services/common/coalesce.py): while busy, a token frame
                        # waits until the window since the last frame has passed, unless the turn
                        # ends first (its final, a cancel, an error: the thread returns); the
                        # tokens that come meanwhile join it.
                        while not future.done() and (hold := flush.hold_s(last_sent)) > 0:
                            await asyncio.wait({future}, timeout=hold)
                        if not queue.empty():
                            event = _coalesce(event, queue)
                        last_sent = flush.clock()
                    if sent == 0:
                        phase.end()
                        phase = tracing.start_span("worker.first_token")
                    yield event
                    sent += 1
                    if sent == 1:
                        phase.end()
                        phase = tracing.start_span("worker.stream_end")
                final = await future
                phase.set_attributes({"meshserve.completion_tokens": final.completion_tokens})
                yield final
            finally:
                phase.end()
                if flush is not None:
                    flush.active -= 1
        finally:
            self.cancel()


class Runner:
    """Owns the engine's thread pool, admission and counters."""

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
    ) -> None:
        self.engine = engine
        # Spaces each stream's token frames while many streams are open (None or window 0: off).
        self.flush = flush if flush is not None and flush.enabled else None
        self.keepalive_s = keepalive_s
        self.sessions = ChatSessions(max_open_chats, chat_idle_timeout_s)
        self.admission = Admission(max_active, max_queue)
        self.counters = WorkerCounters()
        self.executor = ThreadPoolExecutor(max_workers=max_active, thread_name_prefix=f"{name}-seq")
        self.running: dict[asyncio.Future[FinalEvent], Turn] = {}
        self._texts: TokenTexts | None = None

    def token_texts(self) -> TokenTexts:
        """The engine's token texts and bytes (logprobs frames), built on first use and kept."""
        if self._texts is None:
            self._texts = TokenTexts(self.engine.tokenizer)
        return self._texts

    def turn(self, request: GenerationRequest, session: ChatSession | None = None) -> Turn:
        """A new turn; it counts as started once accepted (admitted or queued) by ``events()``.

        Turns of one stream share its ``session`` (KV kept between turns where the engine can).
        """
        self.sessions.sweep()
        return Turn(self, request, session)

    async def sweep_sessions_forever(self) -> None:
        """Free idle chat sequences every few seconds (runs until cancelled)."""
        while True:
            await asyncio.sleep(max(0.5, min(self.sessions.idle_timeout_s / 4, 5.0)))
            self.sessions.sweep()

    def sequence_done(self, future: asyncio.Future[FinalEvent]) -> None:
        self.running.pop(future, None)
        self.admission.release()
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            log.error("sequence_failed", exc_info=exc)
        elif future.result().reason is FinishReason.CANCELLED:
            self.counters.sequence_cancelled()

    async def warmup(self) -> None:
        """A tiny greedy generation through the engine, so the first request does not pay for lazy init."""

        def work() -> None:
            seq = self.engine.start([0], SamplingParams(max_tokens=2))
            try:
                seq.step()
                seq.step()
            finally:
                seq.close()

        await asyncio.get_running_loop().run_in_executor(self.executor, work)

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Cancel every running sequence and wait (bounded) for its thread to finish its step."""
        for turn in list(self.running.values()):
            turn.cancel()
        if self.running:
            await asyncio.wait(list(self.running), timeout=timeout_s)
        self.executor.shutdown(wait=False, cancel_futures=True)
