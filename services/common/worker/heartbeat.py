"""Self-registration: the worker heartbeats its address, tier and load report to each router.

One task per router (``WorkerRegistry.Heartbeat``, internal credential from
``services.common.interceptors.outbound_metadata``). Contract:

* heartbeats never block serving: they run in their own tasks, each call bounded by
  ``timeout_s``; the report is built off the event loop (:class:`LoadReporter`);
* the period is ``interval_s``, shortened to a third of the TTL the router answers with, so two
  lost heartbeats in a row do not get the worker forgotten;
* a failed call is retried after an exponential backoff (``interval_s`` doubling, capped at
  ``max_backoff_s``); the state (registered / unreachable) is logged once per change, not per call;
* :meth:`Heartbeater.leave` (graceful shutdown) cancels the loops and sends one last heartbeat with
  ``leaving`` set, so routers stop sending new work at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog

from services.common.interceptors import outbound_metadata
from services.common.pb.meshserve.internal.v1 import registry_pb2, registry_pb2_grpc, worker_pb2
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.serving import grpc_options

log = structlog.get_logger(__name__)


class Heartbeater:
    """Registers one worker with ``routers`` and keeps it registered (see the module docstring)."""

    def __init__(
        self,
        routers: Sequence[str],
        *,
        address: str,
        tier: inference_pb2.Tier.ValueType,
        stats: Callable[[], Awaitable[worker_pb2.WorkerStats]],
        internal_token: str,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        max_backoff_s: float = 10.0,
    ) -> None:
        self.routers = list(routers)
        self.address = address
        self.tier = tier
        self._stats = stats
        self._token = internal_token
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self._channels = {r: grpc.aio.insecure_channel(r, options=grpc_options()) for r in self.routers}
        self._tasks: list[asyncio.Task[None]] = []
        self.registered: dict[str, bool] = {}
        """Per router: did the last heartbeat succeed (for tests and health pages)."""
        self.beats: dict[str, int] = dict.fromkeys(self.routers, 0)
        """Per router: heartbeats answered."""
        self._changed = asyncio.Event()

    def start(self) -> None:
        for router in self.routers:
            self._tasks.append(asyncio.create_task(self._loop(router), name=f"heartbeat-{router}"))

    async def _beat(self, router: str, *, leaving: bool = False) -> float:
        """One heartbeat; returns the router's TTL in seconds (0 when it sent none)."""
        beat = registry_pb2.WorkerHeartbeat(
            address=self.address,
            tier=self.tier,
            stats=await self._stats(),
            leaving=leaving,
        )
        stub = registry_pb2_grpc.WorkerRegistryStub(self._channels[router])
        reply = await stub.Heartbeat(beat, timeout=self.timeout_s, metadata=outbound_metadata(self._token))
        return reply.ttl_ms / 1000.0

    async def _loop(self, router: str) -> None:
        backoff = self.interval_s
        while True:
            try:
                ttl = await self._beat(router)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # unreachable, refused, bad credential: keep trying, quietly
                self._state(router, False, error=_describe(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            self.beats[router] += 1
            self._state(router, True, ttl_s=ttl)
            backoff = self.interval_s
            await asyncio.sleep(min(self.interval_s, ttl / 3) if ttl > 0 else self.interval_s)

    async def wait_state(self, router: str, up: bool) -> None:
        """Until the last heartbeat to ``router`` succeeded (``up``) or failed (not ``up``)."""
        while self.registered.get(router) is not up:
            self._changed.clear()
            await self._changed.wait()

    def _state(self, router: str, up: bool, **kw: object) -> None:
        if self.registered.get(router) == up:
            return
        self.registered[router] = up
        self._changed.set()
        if up:
            log.info("worker_registered_with_router", router=router, address=self.address, **kw)
        else:
            log.warning("worker_heartbeat_failing", router=router, address=self.address, **kw)

    async def stop(self) -> None:
        """Stop heartbeating without a goodbye (routers forget this worker after their TTL)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def leave(self) -> None:
        """Stop heartbeating and tell every router this worker is leaving (best effort, bounded)."""
        await self.stop()
        results = await asyncio.gather(*(self._beat(r, leaving=True) for r in self.routers), return_exceptions=True)
        for router, result in zip(self.routers, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("worker_leave_not_delivered", router=router, error=_describe(result))
            else:
                log.info("worker_left_router", router=router, address=self.address)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__
