"""The router's request path, transport-agnostic towards its caller.

:meth:`Router.run_turn` serves one generation (a Generate request or one chat turn) as a stream of
:class:`Chunk` events ending with one :class:`Done`: response cache, request collapsing, tier
choice, admission (SLO shedding, fair queuing), replica choice, relay, retries and failover. Its
caller is :class:`~services.router.frontend.api.RouterAPI` (tokenizing, validation, chat sessions), which the
gateway calls in its own process and the router's gRPC servicer wraps.

Failures: a worker that fails before the first token is excluded and another replica (of the other
tier when its own has none left) is tried, up to ``retries_before_first_token``. A worker that dies
or stalls after tokens were sent is replaced, up to ``failovers_after_first_token`` times, by
another replica that prefills prompt + the tokens already sent (``WorkerStart.resume_token_ids``)
and continues; the client stream goes on without duplicate or gap because only the tokens the new
worker generates are relayed (frames are numbered where they are written, not by the workers). The
replacement is a replica of the failed worker's build (``Replica.build``: same weights and numerics,
so the same greedy tokens) when one has a free slot, waiting up to ``resume_same_build_wait_s`` for
one; only then does the stream cross to another build or tier, and its final ``route.reason`` says
``failover_cross_build`` instead of ``failover`` (metric ``meshserve_router_resumes_total``).
worker generates are relayed (frames are numbered where they are written, not by the workers).

n choices (``SamplingParams.n`` > 1) run as one turn on one worker (one prefill, n sequences): the
relay passes each choice's chunks and Done on (``index``) and ends after the n-th Done. Such a turn
is never answered from the response cache, stored there, or collapsed with another request. A
worker that fails before anything was relayed is retried elsewhere like any turn; one that fails
after that ends the request with the worker's error (UNAVAILABLE when it went away): the choices
are not resumed one by one, so none is sent twice or lost without the caller knowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Collection, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial

import structlog

from services.common import errors, tracing
from services.common.generation import GenerationRequest
from services.common.metrics import INTER_TOKEN, TTFT
from services.common.tokenizer import Tokenizer
from services.router.balancer.answers import AnswerKeys, KeyFor, Progress, cached_turn, store_response
from services.router.balancer.blocks import prefix_blocks
from services.router.balancer.collapse import Collapser
from services.router.balancer.host_hold import HostHold
from services.router.balancer.policies.base import Candidate, ReplicaPolicy
from services.router.balancer.policies.cache_aware import CacheAware
from services.router.balancer.registry import Registry, Replica
from services.router.balancer.slo_queue import Admission, Ticket
from services.router.balancer.tiers import TierChoice, TierName, choose_tier
from services.router.balancer.wake import Waker
from services.router.balancer.worker_stream import (
    RESUMABLE,
    RETRYABLE,
    WorkerClosed,
    WorkerFailed,
    WorkerStalled,
    WorkerStream,
    WorkerTransport,
    read_frame,
)
from services.router.metrics import COLLAPSED, FAILOVERS, REPLICA_DECISIONS, RESUMES, RETRIES, ROUTE_DECISIONS
from services.router.types import Chunk, Done, PendingAdmission, Route, TurnRequest, admitted
from services.store.response_cache import ResponseCache

log = structlog.get_logger(__name__)
SERVICE = "router"
__all__ = ["SERVICE", "Router", "Session"]


@dataclass
class Session:
    """Worker-side state that outlives one turn: the open stream of a chat (None for Generate)."""

    stream: WorkerStream | None = None
    choice: TierChoice | None = None
    chat: bool = False
    """A chat session keeps its worker stream across turns (and is never collapsed)."""

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()
            self.stream = None


def same_build(replica: Replica, other: Replica) -> bool:
    """Whether two replicas give the same greedy tokens: equal reported builds; where either has not
    reported one (a worker older than ``WorkerStats.build``), the same tier stands in for it."""
    if replica.build and other.build:
        return replica.build == other.build
    return replica.tier == other.tier


class Router:
    """Dependencies of the request path, built in ``server.py`` and passed in."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        cache: ResponseCache,
        registry: Registry,
        model_id: str,
        model_version: str,
        internal_token: str,
        edge_max_prompt_tokens: int,
        retries_before_first_token: int = 2,
        failovers_after_first_token: int = 2,
        admission: Admission | None = None,
        selector: ReplicaPolicy | None = None,
        block_tokens: int = 16,
        stall_timeout_s: float = 30.0,
        resume_same_build_wait_s: float = 5.0,
        collapse: bool = True,
        tenant_tiers: Mapping[str, Collection[str]] | None = None,
        transport: WorkerTransport,
        serves: Callable[[Replica], bool] | None = None,
        host_hold: HostHold | None = None,
        waker: Waker | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.transport = transport
        """Opens the streams to workers (services/router/balancer/worker_stream.py)."""
        self.cache = cache
        self.registry = registry
        self.model_id = model_id
        self.model_version = model_version
        self._token = internal_token
        self.internal_token = internal_token
        """The credential for calls to workers beside the stream transport (Worker.Embed)."""
        self._edge_max = edge_max_prompt_tokens
        self._retries = retries_before_first_token
        self._failovers = failovers_after_first_token
        self.admission = admission or Admission(lambda tier: 1 << 30)
        self.selector = selector or CacheAware()
        """The replica policy (``routing_policy``: services/router/balancer/policies/), one for all models."""
        self._block = block_tokens
        self._stall_s = stall_timeout_s
        self._same_build_wait_s = resume_same_build_wait_s
        self._slot_freed = asyncio.Event()
        """Set (and replaced) whenever a turn of this router leaves a replica: a resume waiting for a
        same-build slot looks again."""
        self.keys = AnswerKeys(model_id, model_version, tokenizer.fingerprint, cache, collapse)
        self._tenant_tiers = {t: {TierName(x) for x in tiers} for t, tiers in (tenant_tiers or {}).items()}
        self.collapser: Collapser[Chunk | Done] = Collapser()
        self.serves = serves
        """Which of the registry's replicas run this model version (None: all of them)."""
        self.host_hold = host_hold
        """Told of every foreground turn's start and end on a replica: the host's background work holds
        meanwhile (services/router/balancer/host_hold.py; None: not told)."""
        self.waker = waker
        """Holds a request while the version has no awake replica and wakes one (services/router/balancer/wake.py);
        None: no holding (a request finding no awake replica is refused at once)."""

    def replicas(self) -> list[Replica]:
        """Every replica of this model version the registry knows (healthy or not, awake or not)."""
        return [r for r in self.registry.replicas if self.serves is None or self.serves(r)]

    def healthy(self, tier: TierName) -> list[Replica]:
        """The healthy replicas of ``tier`` that serve this router's model version."""
        replicas = self.registry.healthy(tier)
        return replicas if self.serves is None else [r for r in replicas if self.serves(r)]

    def tiers(self) -> set[TierName]:
        """Tiers with replicas of this model version configured (healthy or not)."""
        return {r.tier for r in self.registry.replicas if self.serves is None or self.serves(r)}

    def answer_tier(self, req: TurnRequest, session: Session) -> TierName:
        """The tier whose weights will answer ``req``, decided before the cache lookup: a chat's current
        worker's tier, else the routing decision (tenant tiers, hint, length, health, load). With no
        usable worker at all, the tier the request prefers: a cached answer still serves then."""
        if session.stream is not None and session.choice is not None:
            return session.choice.tier
        try:
            return self.choose(req, ()).tier
        except errors.Unavailable:
            tiers = self._tenant_tiers.get(req.tenant)
            return choose_tier(len(req.prompt_ids), req.hint, tiers or set(TierName), self._edge_max, (), tiers).tier

    def choose(self, req: TurnRequest, exclude: Sequence[Replica]) -> TierChoice:
        """The tier: by policy over tiers with a healthy replica not in ``exclude``."""
        usable = {t for t in TierName if any(r not in exclude for r in self.healthy(t))}
        saturated = {t for t in usable if self.admission.saturated(t)}
        allowed = self._tenant_tiers.get(req.tenant)
        return choose_tier(len(req.prompt_ids), req.hint, usable, self._edge_max, saturated, allowed)

    def blocks(self, req: TurnRequest) -> list[bytes]:
        if req.prefix_blocks is None:
            req.prefix_blocks = prefix_blocks(
                req.prompt_ids,
                self._block,
                model_id=self.model_id,
                model_version=self.model_version,
                tenant=req.tenant,
                shareable=req.shareable,
            )
        return req.prefix_blocks

    def select(self, req: TurnRequest, tier: TierName, exclude: Sequence[Replica]) -> Replica:
        """The replica of ``tier`` (healthy, not excluded) by the configured policy."""
        replicas = [r for r in self.healthy(tier) if r not in exclude]
        if not replicas:
            raise errors.Unavailable("no healthy worker can serve this request right now; retry in a few seconds")
        cands = [Candidate(r.address, self._placement_load(req, r), r.hot_blocks, r.kv_full) for r in replicas]
        sel = self.selector.select(cands, self.blocks(req), group=f"{self.model_id}/{self.model_version}/{tier.value}")
        REPLICA_DECISIONS.labels(tier.value, sel.reason).inc()
        return next(r for r in replicas if r.address == sel.name)

    @staticmethod
    def _placement_load(req: TurnRequest, replica: Replica) -> int:
        """The replica's load as ``req`` sees it: a foreground turn does not count this router's
        background turns there while the replica has a free slot (they hold while it runs:
        services/edge_worker/hold.py), so it is not crowded onto another foreground turn's worker."""
        if req.background or not replica.background_in_flight or not replica.has_slot:
            return replica.load
        return max(0, replica.load - replica.background_in_flight)

    def pick(self, req: TurnRequest, exclude: Sequence[Replica]) -> tuple[TierChoice, Replica]:
        choice = self.choose(req, exclude)
        return choice, self.select(req, choice.tier, exclude)

    async def resume_replica(self, req: TurnRequest, failed: Replica, exclude: Sequence[Replica]) -> Replica | None:
        """A replica of ``failed``'s build (not in ``exclude``) with a free slot, waiting up to
        ``resume_same_build_wait_s`` for one; None when there is no such replica or none freed up in
        time (the caller then picks by policy, crossing builds). Counts the outcome."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._same_build_wait_s
        waited = False
        while True:
            peers = [r for r in self.registry.healthy(failed.tier) if r not in exclude and same_build(r, failed)]
            free = [r for r in peers if r.has_slot]
            if free:
                RESUMES.labels(failed.tier.value, "same_build_after_wait" if waited else "same_build").inc()
                return self.select(req, failed.tier, [r for r in self.registry.replicas if r not in free])
            left = deadline - loop.time()
            if not peers or left <= 0:
                RESUMES.labels(failed.tier.value, "cross_build_busy" if peers else "cross_build_none").inc()
                log.warning(
                    "resume_crossing_build",
                    worker=failed.name,
                    build=failed.build,
                    why="every replica of its build stayed busy" if peers else "no healthy replica of its build",
                    waited_s=round(self._same_build_wait_s - max(left, 0.0), 3),
                )
                return None
            waited = True
            # A turn of ours leaving a replica wakes us; other routers' turns show in heartbeats (1 s).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), min(left, 0.25))

    def _freed_slot(self) -> None:
        self._slot_freed.set()
        self._slot_freed = asyncio.Event()

    async def run_turn(
        self,
        req: TurnRequest,
        session: Session,
        cancel: asyncio.Event | None = None,
        admission: PendingAdmission | None = None,
    ) -> AsyncGenerator[Chunk | Done, None]:
        """Serve one generation: from the cache, by joining an identical one in flight, else a worker.

        ``cancel``: set to end the turn early (a chat's cancel; the worker sends a CANCELLED final).
        ``admission``: the caller's reservation if still pending (services/router/types.py): no work
        reaches a worker before it is granted, except a speculative start, aborted if it is refused.
        """
        started = time.perf_counter()
        cacheable = req.use_cache and req.sampling.deterministic and req.sampling.n == 1
        tier = self.answer_tier(req, session) if cacheable else None
        key = self.keys.cache_key(req, tier) if tier is not None else None
        # Stored under the tier that served, which a retry or fallback may have changed.
        key_for = partial(self.keys.key, req) if key is not None else None
        if key is not None and tier is not None and (hit := await cached_turn(self.cache, key, tier, req)):
            ROUTE_DECISIONS.labels(tier.value, "cache_hit").inc()
            TTFT.labels(SERVICE, "cache").observe(time.perf_counter() - started)
            for event in hit:
                yield event
            return
        ckey = self.keys.collapse_key(req, tier, chat=session.chat) if tier is not None else None
        if ckey is None:
            async with aclosing(self._serve(req, session, cancel, admission, key_for, started)) as events:
                async for event in events:
                    yield event
            return
        # A shared computation must not start (nor be joined) on an admission that may yet be refused:
        # its error would end every waiter's stream.
        await admitted(admission)
        counted = False
        async with aclosing(self.collapser.run(ckey, lambda: self._serve_alone(req, key_for, started))) as shared:
            async for event, joined in shared:
                if joined and not counted:
                    counted = True
                    COLLAPSED.inc()
                if joined and isinstance(event, Done):
                    label = event.route.tier.value if event.route.tier else "none"
                    ROUTE_DECISIONS.labels(label, "collapsed").inc()
                    event = replace(event, route=replace(event.route, reason="collapsed"))
                yield event

    async def _serve_alone(
        self, req: TurnRequest, key_for: KeyFor | None, started: float
    ) -> AsyncGenerator[Chunk | Done]:
        session = Session()
        try:
            async with aclosing(self._serve(req, session, None, None, key_for, started)) as events:
                async for event in events:
                    yield event
        finally:
            await session.close()

    async def _serve(
        self,
        req: TurnRequest,
        session: Session,
        cancel: asyncio.Event | None,
        admission: PendingAdmission | None,
        key_for: KeyFor | None,
        started: float,
    ) -> AsyncGenerator[Chunk | Done, None]:
        exclude: list[Replica] = []
        failure: errors.MeshError | None = None
        progress = Progress()
        ticket: Ticket | None = None
        running: Replica | None = None
        broken: Replica | None = None  # the worker a resume replaces
        waker = self.waker
        if waker is not None:
            waker.touch()
        try:
            while True:
                # No awake replica (but the ones that failed): held while one wakes, also for a retry or
                # a resume. A chat already on a replica (session.stream) goes on there.
                if session.stream is None and waker is not None and waker.must_hold(exclude):
                    with tracing.span("router.hold"):
                        await waker.hold(req.timeout, exclude)
                if session.stream is None:
                    with tracing.span("router.route_decision") as decision:  # tier, router queue, replica
                        same = await self.resume_replica(req, broken, exclude) if broken is not None else None
                        try:
                            picked = self.choose(req, exclude) if same is None else TierChoice(same.tier, "failover")
                        except errors.Unavailable:
                            raise failure or errors.Unavailable(
                                "no healthy worker can serve this request right now; retry in a few seconds"
                            ) from None
                        session.choice = picked
                        if ticket is None:
                            ticket = await self._admit(req, picked.tier)
                        replica = same or self.select(req, picked.tier, exclude)
                        if broken is not None and replica.build != broken.build and replica.build and broken.build:
                            progress.crossed = True  # only when both builds are known: else we cannot say
                        broken = None
                        decision.set_attributes({"meshserve.tier": picked.tier.value, "meshserve.worker": replica.name})
                    session.stream = self.transport.open(replica, req.timeout)
                    structlog.contextvars.bind_contextvars(worker=replica.name, tier=picked.tier.value)
                elif ticket is None:
                    assert session.choice is not None
                    ticket = await self._admit(req, session.choice.tier)
                stream = session.stream
                choice = session.choice
                assert stream is not None and choice is not None
                running = stream.replica
                running.in_flight += 1
                running.background_in_flight += req.background
                holds = self.host_hold if not req.background else None
                if holds is not None:
                    holds.started(running.address)
                try:
                    async with aclosing(
                        self._relay(req, stream, choice, cancel, admission, progress, started)
                    ) as events:
                        async for event in events:
                            if isinstance(event, Done) and event.last:
                                await store_response(self.cache, key_for, req, progress, event)
                                self.admission.release(ticket, time.perf_counter() - started)
                            yield event
                            if isinstance(event, Done) and event.last:
                                return
                except WorkerFailed as exc:
                    await session.close()
                    failovers = progress.failovers
                    failure = self._failed(exc, stream, choice, progress, exclude, failure)
                    if progress.failovers > failovers:
                        broken = stream.replica
                finally:
                    running.in_flight -= 1
                    running.background_in_flight -= req.background
                    if holds is not None:
                        holds.ended(running.address)
                    self._freed_slot()
        except BaseException:
            # Caller went away (CancelledError) or we failed: the worker must stop generating now.
            if session.stream is not None:
                session.stream.abort()
                session.stream = None
            raise
        finally:
            if ticket is not None:
                self.admission.release(ticket)
            if waker is not None:
                waker.touch()

    def _failed(
        self,
        exc: WorkerFailed,
        stream: WorkerStream,
        choice: TierChoice,
        progress: Progress,
        exclude: list[Replica],
        failure: errors.MeshError | None,
    ) -> errors.MeshError | None:
        """Decide what a worker failure means: retry, resume elsewhere, or raise to the caller."""
        code = exc.code
        if code == "UNAVAILABLE":
            self.registry.mark_down(stream.replica, "stalled" if isinstance(exc, WorkerStalled) else "call_failed")
            self.selector.forget(stream.replica.address)
        name = stream.replica.name
        if not progress.tokens and not progress.finals and len(exclude) < self._retries and code in RETRYABLE:
            log.warning("worker_failed_retrying", worker=name, code=code)
            RETRIES.labels(choice.tier.value, code).inc()
            exclude.append(stream.replica)
            return exc.error
        # n choices are not resumed (the router keeps one token list per turn): see the module docstring.
        resumable = progress.tokens and progress.choices == 1
        if resumable and progress.failovers < self._failovers and code in RESUMABLE:
            log.warning("worker_failed_resuming", worker=name, code=code, tokens_sent=len(progress.tokens))
            FAILOVERS.labels(choice.tier.value, code).inc()
            exclude.append(stream.replica)
            progress.failovers += 1
            progress.resumed = len(progress.tokens)
            return failure
        log.warning("worker_failed", worker=name, code=code, tokens_sent=len(progress.tokens))
        gone = errors.Unavailable("the worker serving this request failed; retry the request")
        raise exc.error or gone from None

    async def _admit(self, req: TurnRequest, tier: TierName) -> Ticket:
        blocks = self.blocks(req)
        cached = max(
            (self.selector.cached_blocks(r.address, blocks, r.hot_blocks) for r in self.healthy(tier)),
            default=0,
        )
        return await self.admission.acquire(
            tier,
            tenant=req.tenant,
            priority=req.priority,
            cost=len(req.prompt_ids) + req.sampling.max_tokens,
            uncached_tokens=len(req.prompt_ids) - cached * self._block,
        )

    async def _relay(
        self,
        req: TurnRequest,
        stream: WorkerStream,
        choice: TierChoice,
        cancel: asyncio.Event | None,
        admission: PendingAdmission | None,
        progress: Progress,
        started: float,
    ) -> AsyncGenerator[Chunk | Done, None]:
        early = admission is not None and admission.may_start_early()
        if not early:
            await admitted(admission)
        await stream.start(
            GenerationRequest(
                request_id=req.request_id,
                prompt_ids=tuple(req.prompt_ids),
                sampling=req.sampling,
                tenant=req.tenant,
                resume_ids=tuple(progress.tokens),
                shareable=req.shareable,
                priority=req.priority,
                background=req.background,
            )
        )
        if early:
            assert admission is not None
            admission.on_refused(stream.abort)  # its reader then fails, and the refusal is raised below
        tier = choice.tier.value
        inter_token = INTER_TOKEN.labels(SERVICE, tier)
        cancel_sent = False
        last = 0.0
        expected = 0
        choices = req.sampling.n
        progress.choices = choices
        while True:
            try:
                frame, cancel_sent = await read_frame(stream, cancel, cancel_sent, self._stall_s)
            except (WorkerFailed, asyncio.CancelledError):
                # A speculative start whose reservation was refused has been aborted: the refusal.
                refused = admission.refusal() if admission is not None else None
                task = asyncio.current_task()
                if refused is None or (task is not None and task.cancelling()):
                    raise
                raise refused from None
            if frame.queued:  # the turn waits for a slot on a live worker: the stall timer restarts
                continue
            if frame.sequence != expected:
                raise WorkerClosed(f"worker frame {frame.sequence} arrived where {expected} was due")
            expected += 1
            if frame.token_ids or frame.text:
                now = time.perf_counter()
                if not progress.tokens:
                    TTFT.labels(SERVICE, tier).observe(now - started)
                    ROUTE_DECISIONS.labels(tier, choice.reason).inc()
                elif frame.token_ids:
                    gap = (now - last) / len(frame.token_ids)
                    for _ in frame.token_ids:
                        inter_token.observe(gap)
                last = now
                progress.tokens.extend(frame.token_ids)
                progress.tiers.add(choice.tier)
                progress.text.append(frame.text)
                yield Chunk(list(frame.token_ids), frame.text, index=frame.index, logprobs=frame.logprobs)
            if frame.final is not None:
                if not progress.tokens and not progress.finals:
                    ROUTE_DECISIONS.labels(tier, choice.reason).inc()
                final = frame.final
                if choices == 1:
                    produced = progress.resumed + (final.completion_tokens or len(progress.tokens) - progress.resumed)
                else:
                    produced = final.completion_tokens
                reason = choice.reason
                if progress.failovers:
                    reason = "failover_cross_build" if progress.crossed else "failover"
                progress.finals += 1
                ended = progress.finals >= choices
                yield Done(
                    final.reason,
                    len(req.prompt_ids),
                    produced,
                    Route(choice.tier, stream.replica.name, False, reason),
                    frame.index,
                    ended,
                    final.budget_closed,
                )
                if ended:
                    return
