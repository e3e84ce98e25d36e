"""The router's request path, transport-agnostic towards its caller: cache, tier, replica, relay.

:meth:`Router.run_turn` serves one generation (a Generate request or one chat turn) as a stream of
:class:`Chunk` events ending with one :class:`Done`. The servicer only translates protos.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import structlog

from services.cache.keys import SamplingSpec, response_key
from services.cache.store import CachedResponse, Finish, ResponseCache
from services.common import errors
from services.common.interceptors import outbound_metadata
from services.common.metrics import INTER_TOKEN, TTFT
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.tokenizer import Tokenizer
from services.router.metrics import RETRIES, ROUTE_DECISIONS
from services.router.policy import RoundRobin, TierChoice, TierName, choose_tier
from services.router.registry import Registry, Replica
from services.router.worker_stream import RETRYABLE, WorkerClosed, WorkerStream, domain_error

log = structlog.get_logger(__name__)
SERVICE = "router"
_CACHEABLE_FINISH = {int(f) for f in Finish}


@dataclass(frozen=True)
class Route:
    """Where a turn was served (RouteInfo)."""

    tier: TierName | None
    worker_id: str
    cache_hit: bool
    reason: str


@dataclass(frozen=True)
class Chunk:
    token_ids: Sequence[int]
    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: int  # meshserve.v1.FinishReason value
    prompt_tokens: int
    completion_tokens: int
    route: Route


@dataclass
class TurnRequest:
    """One generation to serve: prompt ids already validated against the context length."""

    prompt_ids: list[int]
    sampling: SamplingSpec
    hint: TierName | None
    use_cache: bool
    shareable: bool
    tenant: str
    request_id: str
    timeout: float | None = None


@dataclass
class Session:
    """Worker-side state that outlives one turn: the open stream of a chat (None for Generate)."""

    stream: WorkerStream | None = None
    choice: TierChoice | None = None

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()
            self.stream = None


@dataclass
class _Progress:
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


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
    ) -> None:
        self.tokenizer = tokenizer
        self.cache = cache
        self.registry = registry
        self.model_id = model_id
        self.model_version = model_version
        self._token = internal_token
        self._edge_max = edge_max_prompt_tokens
        self._retries = retries_before_first_token
        self._rr = RoundRobin()

    def cache_key(self, req: TurnRequest) -> str | None:
        """The response-cache key of ``req``, or None when it must not use the cache."""
        if not (req.use_cache and self.cache.enabled and req.sampling.deterministic):
            return None
        return response_key(
            model_id=self.model_id,
            model_version=self.model_version,
            tokenizer_id=self.tokenizer.fingerprint,
            sampling=req.sampling,
            prompt_ids=req.prompt_ids,
            tenant=req.tenant,
            shareable=req.shareable,
        )

    def pick(self, prompt_tokens: int, hint: TierName | None, exclude: Sequence[Replica]) -> tuple[TierChoice, Replica]:
        """Tier by policy, then round-robin over that tier's healthy replicas not in ``exclude``."""
        candidates = {tier: [r for r in self.registry.healthy(tier) if r not in exclude] for tier in TierName}
        choice = choose_tier(prompt_tokens, hint, {t for t, rs in candidates.items() if rs}, self._edge_max)
        replica = self._rr.pick(choice.tier.value, candidates[choice.tier])
        assert replica is not None
        return choice, replica

    async def run_turn(
        self, req: TurnRequest, session: Session, cancel: asyncio.Event | None = None
    ) -> AsyncGenerator[Chunk | Done, None]:
        """Serve one generation: from the cache, else from a worker.

        A worker that fails before the first token is excluded and the request goes to another
        replica, of the other tier if its own has none left, up to ``retries_before_first_token``.
        """
        started = time.perf_counter()
        key = self.cache_key(req)
        if key is not None:
            hit = await self.cache.get(key)
            if hit is not None:
                ROUTE_DECISIONS.labels("none", "cache_hit").inc()
                TTFT.labels(SERVICE, "cache").observe(time.perf_counter() - started)
                yield Chunk(hit.token_ids, hit.text)
                route = Route(None, "", True, "cache_hit")
                yield Done(int(hit.finish), len(req.prompt_ids), hit.completion_tokens, route)
                return
        exclude: list[Replica] = []
        failure: errors.MeshError | None = None
        progress = _Progress()
        while True:
            if session.stream is None:
                try:
                    picked, replica = self.pick(len(req.prompt_ids), req.hint, exclude)
                except errors.Unavailable:
                    raise failure or errors.Unavailable(
                        "no healthy worker can serve this request right now; retry in a few seconds"
                    ) from None
                session.choice = picked
                session.stream = WorkerStream(replica, outbound_metadata(self._token), req.timeout)
                structlog.contextvars.bind_contextvars(worker=replica.name, tier=picked.tier.value)
            stream = session.stream
            choice = session.choice
            assert choice is not None
            try:
                async with aclosing(self._relay(req, stream, choice, cancel, progress, started)) as events:
                    async for event in events:
                        if isinstance(event, Done) and key is not None and event.finish_reason in _CACHEABLE_FINISH:
                            # Stored before the final frame goes out, so a repeat sent right after it hits.
                            await self.cache.put(
                                key,
                                CachedResponse(
                                    tuple(progress.tokens),
                                    "".join(progress.text),
                                    Finish(event.finish_reason),
                                    len(req.prompt_ids),
                                    event.completion_tokens,
                                ),
                            )
                        yield event
                        if isinstance(event, Done):
                            return
            except (grpc.aio.AioRpcError, WorkerClosed) as exc:
                await session.close()
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
                if code == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_down(stream.replica, "call_failed")
                if not progress.tokens and len(exclude) < self._retries and code in RETRYABLE:
                    log.warning("worker_failed_retrying", worker=stream.replica.name, code=code.name)
                    RETRIES.labels(choice.tier.value, code.name).inc()
                    exclude.append(stream.replica)
                    failure = domain_error(exc) if isinstance(exc, grpc.aio.AioRpcError) else None
                    continue
                log.warning(
                    "worker_failed", worker=stream.replica.name, code=code.name, tokens_sent=len(progress.tokens)
                )
                if isinstance(exc, grpc.aio.AioRpcError):
                    raise domain_error(exc) from None
                raise errors.Unavailable("the worker serving this request failed; retry the request") from None
            except BaseException:
                # Caller went away (CancelledError) or we failed: the worker must stop generating now.
                if session.stream is not None:
                    session.stream.abort()
                    session.stream = None
                raise

    async def _relay(
        self,
        req: TurnRequest,
        stream: WorkerStream,
        choice: TierChoice,
        cancel: asyncio.Event | None,
        progress: _Progress,
        started: float,
    ) -> AsyncGenerator[Chunk | Done, None]:
        await stream.start(
            worker_pb2.WorkerStart(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_ids,
                sampling=_sampling_pb(req.sampling),
                tenant=req.tenant,
            )
        )
        tier = choice.tier.value
        cancel_sent = False
        last = 0.0
        while True:
            if cancel is not None and not cancel_sent:
                frame, cancel_sent = await _read_or_cancel(stream, cancel)
            else:
                frame = await stream.read()
            if frame.token_ids or frame.text:
                now = time.perf_counter()
                if not progress.tokens:
                    TTFT.labels(SERVICE, tier).observe(now - started)
                    ROUTE_DECISIONS.labels(tier, choice.reason).inc()
                elif frame.token_ids:
                    gap = (now - last) / len(frame.token_ids)
                    for _ in frame.token_ids:
                        INTER_TOKEN.labels(SERVICE, tier).observe(gap)
                last = now
                progress.tokens.extend(frame.token_ids)
                progress.text.append(frame.text)
                yield Chunk(list(frame.token_ids), frame.text)
            if frame.HasField("final"):
                if not progress.tokens:
                    ROUTE_DECISIONS.labels(tier, choice.reason).inc()
                final = frame.final
                yield Done(
                    final.finish_reason or inference_pb2.FINISH_REASON_STOP,
                    len(req.prompt_ids),
                    final.completion_tokens or len(progress.tokens),
                    Route(choice.tier, stream.replica.name, False, choice.reason),
                )
                return


async def _read_or_cancel(stream: WorkerStream, cancel: asyncio.Event) -> tuple[worker_pb2.WorkerResponse, bool]:
    """The next frame; if ``cancel`` fires first, send WorkerCancel and keep reading."""
    if cancel.is_set():
        await stream.cancel_turn()
        return await stream.read(), True
    read = asyncio.ensure_future(stream.read())
    waiter = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait({read, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        read.cancel()
        raise
    finally:
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
    sent = False
    if cancel.is_set():
        await stream.cancel_turn()
        sent = True
    return await read, sent


def _sampling_pb(s: SamplingSpec) -> inference_pb2.SamplingParams:
    msg = inference_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, stop=list(s.stop)
    )
    if s.seed is not None:
        msg.seed = s.seed
    return msg
