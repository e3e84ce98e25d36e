"""The router's live view of its workers: one channel per replica, health polled in the background.

Every ``interval_s`` each replica is probed with ``grpc.health.v1.Health/Check`` and
``Worker.Stats`` (identity and load). A replica is up when health says SERVING and Stats answers.
A call that fails with UNAVAILABLE marks its replica down at once (``mark_down``); the next
successful probe brings it back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import metadata as md
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.serving import grpc_options
from services.router.policy import TierName

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class Replica:
    """One worker replica: its address, channel and last known health/load."""

    address: str
    tier: TierName
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    healthy: bool = False
    worker_id: str = ""
    active_sequences: int = 0
    queue_depth: int = 0
    failures: int = field(default=0)

    @property
    def name(self) -> str:
        """The worker id it reports, or its address before the first Stats answer."""
        return self.worker_id or self.address


class Registry:
    """Replicas of both tiers and their health. Call :meth:`start` inside the event loop."""

    def __init__(
        self,
        edge: Sequence[str],
        cloud: Sequence[str],
        *,
        internal_token: str,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        on_change: Callable[[bool], object] | None = None,
    ) -> None:
        self._addresses = [(a, TierName.EDGE) for a in edge] + [(a, TierName.CLOUD) for a in cloud]
        self._token = internal_token
        self._interval = interval_s
        self._timeout = timeout_s
        self._on_change = on_change
        self.replicas: list[Replica] = []
        self._task: asyncio.Task[None] | None = None
        self._any_up: bool | None = None

    async def start(self) -> None:
        """Open the channels, probe every replica once, then keep polling in the background."""
        for address, tier in self._addresses:
            channel = grpc.aio.insecure_channel(address, options=grpc_options())
            self.replicas.append(Replica(address, tier, channel, worker_pb2_grpc.WorkerStub(channel)))
        await self.probe_all()
        self._task = asyncio.create_task(self._poll(), name="router-health-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for r in self.replicas:
            await r.channel.close()

    def tiers(self) -> set[TierName]:
        """Tiers that have replicas configured (healthy or not)."""
        return {r.tier for r in self.replicas}

    def healthy(self, tier: TierName) -> list[Replica]:
        return [r for r in self.replicas if r.tier is tier and r.healthy]

    def healthy_tiers(self) -> set[TierName]:
        return {r.tier for r in self.replicas if r.healthy}

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("worker_marked_down", worker=replica.name, address=replica.address, reason=reason)
        replica.healthy = False
        replica.failures += 1
        self._notify()

    async def probe_all(self) -> None:
        """Probe every replica now (the background loop calls this every interval)."""
        await asyncio.gather(*(self._probe(r) for r in self.replicas))
        self._notify()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.probe_all()
            except Exception:  # the poller must survive anything; the next round retries
                log.exception("health_poll_failed")

    async def _probe(self, r: Replica) -> None:
        meta = ((md.INTERNAL_TOKEN, self._token),)
        try:
            health = await health_pb2_grpc.HealthStub(r.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self._timeout
            )
            up = health.status == health_pb2.HealthCheckResponse.SERVING
            if up:
                stats = await r.stub.Stats(worker_pb2.StatsRequest(), timeout=self._timeout, metadata=meta)
                r.worker_id = stats.worker_id or r.worker_id
                r.active_sequences = stats.active_sequences
                r.queue_depth = stats.queue_depth
        except grpc.aio.AioRpcError as exc:
            up = False
            if r.healthy:
                log.warning("worker_probe_failed", worker=r.name, address=r.address, code=exc.code().name)
        if up != r.healthy:
            log.info("worker_health_changed", worker=r.name, address=r.address, tier=r.tier.value, up=up)
        r.healthy = up

    def _notify(self) -> None:
        any_up = any(r.healthy for r in self.replicas)
        if any_up != self._any_up:
            self._any_up = any_up
            if self._on_change is not None:
                self._on_change(any_up)
