"""The router's live view of its workers: one channel per replica, health polled in the background.

Every ``interval_s`` each replica is probed with ``grpc.health.v1.Health/Check`` and
``Worker.Stats`` (identity and load). A replica is up when health says SERVING and Stats answers; a
healthy replica whose probes merely time out stays up until ``probe_timeouts_to_down`` probes in a row
have timed out (a busy worker answers late; a dead one refuses or stalls its streams).
Outlier ejection: a call that fails with UNAVAILABLE or stalls ejects its replica at once
(``mark_down``) for ``eject_base_s * 2**(consecutive ejections - 1)`` (capped at ``eject_max_s``);
probes cannot bring it back before that. Re-admission is gradual: for ``readmit_s`` after it
comes back, a replica carries an extra routing load that decays linearly from its slot count to 0
(:attr:`Replica.load`), so it takes a growing share of new traffic instead of all of it at once.
A replica that stays healthy for ``readmit_s`` has its ejection count reset.

Replicas come from static config and from self-registration (:meth:`Registry.heartbeat`, served as
``WorkerRegistry.Heartbeat``): an unknown address is added (after one health probe), every
heartbeat refreshes its load report, and a registered replica whose heartbeats stop for
``heartbeat_ttl_s`` (or that says it is leaving) is removed; its channel is closed with a grace
period, so streams still running on a draining worker finish. Static replicas are never removed.
Bounds: at most ``max_replicas`` replicas (static + registered); a new address beyond that is refused
(ResourceExhausted), and what the router keeps per address (``on_drop``) goes with its replica.

Load reports (:class:`WorkerReport`) arrive both ways, pushed by heartbeats and pulled by the
``Worker.Stats`` probe; the latest one wins. What the policy uses from them: ``active + queued``
(:attr:`Replica.load`), ``max_active`` (admission slots), KV usage (:attr:`Replica.kv_full`: at or
above ``kv_high_watermark`` of the worker's KV budget, the replica takes no new turns while another
has room and gives no admission slots) and the hot prefix blocks (:attr:`Replica.hot_blocks`, only
when the worker hashed them with the router's block size and model version; otherwise they could
never match and a warning says why; at most :data:`MAX_REPORTED_BLOCKS` of them are kept). Such a
report is the truth about what the worker holds, so ``on_report`` lets the router drop its own belief
(what it sent there before the report).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import metadata as md
from services.common import model_state_pb
from services.common.errors import MeshError, ResourceExhausted, Unavailable
from services.common.model_state import ModelState
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.serving import grpc_options
from services.common.status_errors import Upstream, from_rpc_error
from services.router.balancer.tiers import TierName
from services.router.metrics import EJECTIONS

log = structlog.get_logger(__name__)
MAX_REPORTED_BLOCKS = 4096
"""Hot prefix blocks kept from one report (a worker sends at most 1024 by default); the rest are
ignored, so a peer's oversized report cannot make the router hold more than ~130 KiB per replica."""


def model_state(value: int) -> ModelState:
    """The state of a pb ``ModelState`` (an unknown number: awake, as a worker before the field)."""
    state = model_state_pb.from_pb(value)
    return ModelState.AWAKE if state is None else state


@dataclass(frozen=True)
class WorkerReport:
    """A worker's load report (``WorkerStats``) as the router keeps it."""

    worker_id: str = ""
    active: int = 0
    queued: int = 0
    max_active: int = 0
    tokens_per_s: float = 0.0
    kv_used_bytes: int = 0
    kv_budget_bytes: int = 0
    kv_tokens: int = 0
    held_sequences: int = 0
    block_tokens: int = 0
    hot_blocks: tuple[bytes, ...] = ()
    model_version: str = ""
    prompt_tokens_total: int = 0
    prefill_tokens_total: int = 0
    stream_port: int = 0  # the worker's stream transport listens on this port (0: none announced)
    model_id: str = ""
    build: str = ""
    """The worker's build (``WorkerStats.build``): equal builds give equal greedy tokens; "" = unknown."""
    model_state: ModelState = ModelState.AWAKE
    """Whether the worker holds its model (``WorkerStats.model_state``; a worker before it: awake)."""
    resident_bytes: int = 0
    """The worker process's resident memory (``WorkerStats.resident_bytes``; 0: not reported)."""

    @classmethod
    def from_pb(cls, s: worker_pb2.WorkerStats) -> WorkerReport:
        return cls(
            worker_id=s.worker_id,
            active=s.active_sequences,
            queued=s.queue_depth,
            max_active=s.max_active_sequences,
            tokens_per_s=s.recent_tokens_per_second,
            kv_used_bytes=s.kv_used_bytes,
            kv_budget_bytes=s.kv_budget_bytes,
            kv_tokens=s.kv_tokens,
            held_sequences=s.held_sequences,
            block_tokens=s.prefix_block_tokens,
            hot_blocks=tuple(s.hot_prefix_blocks[:MAX_REPORTED_BLOCKS]),
            model_id=s.model,
            model_version=s.model_version,
            prompt_tokens_total=s.prompt_tokens_total,
            prefill_tokens_total=s.prefill_tokens_total,
            stream_port=s.stream_port,
            build=s.build,
            model_state=model_state(s.model_state),
            resident_bytes=s.resident_bytes,
        )

    @property
    def kv_usage(self) -> float | None:
        """Fraction of the KV budget in use; None when the worker has no fixed budget."""
        return self.kv_used_bytes / self.kv_budget_bytes if self.kv_budget_bytes else None


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
    max_active: int = 4
    failures: int = field(default=0)
    probe_timeouts: int = 0
    """Consecutive health/Stats probes that timed out (reset by any answer)."""
    in_flight: int = 0
    """Turns this router has running on the replica now."""
    background_in_flight: int = 0
    """Of ``in_flight``, the background ones (batch lines, :attr:`Routing.background`)."""
    ejections: int = 0
    ejected_until: float = 0.0
    readmitted_at: float = 0.0
    readmit_s: float = 0.0
    registered_until: float = 0.0
    """For a self-registered replica: forgotten after this time without a heartbeat (0 = static)."""
    report: WorkerReport = field(default_factory=WorkerReport)
    """The latest load report (heartbeat or Stats probe)."""
    reported_at: float = 0.0
    hot_blocks: frozenset[bytes] = frozenset()
    """Prefix block hashes the worker reports holding KV for (empty when its hashes cannot match ours)."""
    kv_high_watermark: float = 1.0

    @property
    def kv_full(self) -> bool:
        """The worker's KV budget is (nearly) used up: give it no new turns while others have room."""
        usage = self.report.kv_usage
        return usage is not None and usage >= self.kv_high_watermark

    @property
    def build(self) -> str:
        """The build the worker reports serving ("" until it reports one)."""
        return self.report.build

    @property
    def state(self) -> ModelState:
        """Whether it holds its model (its latest report)."""
        return self.report.model_state

    @property
    def routable(self) -> bool:
        """Healthy and awake: new turns may go to it (an asleep one is woken first:
        services/router/balancer/wake.py)."""
        return self.healthy and self.report.model_state is ModelState.AWAKE

    @property
    def has_slot(self) -> bool:
        """A new turn would start at once: fewer turns on it (ours, or all it reported) than its slots."""
        return max(self.in_flight, self.active_sequences + self.queue_depth) < self.max_active

    @property
    def load(self) -> int:
        """Routing load: ``max(in_flight, active + queued)`` plus the re-admission penalty."""
        base = max(self.in_flight, self.active_sequences + self.queue_depth)
        if self.readmit_s > 0 and self.readmitted_at:
            left = 1.0 - (time.monotonic() - self.readmitted_at) / self.readmit_s
            if left > 0:
                base += math.ceil(left * self.max_active)
        return base

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
        eject_base_s: float = 1.0,
        eject_max_s: float = 30.0,
        readmit_s: float = 10.0,
        heartbeat_ttl_s: float = 5.0,
        block_tokens: int = 16,
        model_version: str = "",
        kv_high_watermark: float = 0.95,
        drain_s: float = 30.0,
        on_report: Callable[[Replica], object] | None = None,
        probe_timeouts_to_down: int = 3,
        max_replicas: int = 1024,
        on_drop: Callable[[str], object] | None = None,
        model_versions: Collection[str] = (),
    ) -> None:
        self._addresses = [(a, TierName.EDGE) for a in edge] + [(a, TierName.CLOUD) for a in cloud]
        self._token = internal_token
        self._interval = interval_s
        self._timeout = timeout_s
        self._timeouts_to_down = max(1, probe_timeouts_to_down)
        self._on_change = on_change
        self._eject_base = eject_base_s
        self._eject_max = eject_max_s
        self._readmit = readmit_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._block_tokens = block_tokens
        self._model_version = model_version
        # Builds whose hot prefix blocks are ours to match: the one version, or every served one.
        self._model_versions = {model_version, *model_versions}
        self._kv_high = kv_high_watermark
        self._drain_s = drain_s
        self._mismatch_warned: set[str] = set()
        self._on_report = on_report
        """Called with a replica whose report lists its hot prefix blocks in our scheme (authoritative)."""
        self.max_replicas = max_replicas
        self._on_drop = on_drop  # called with a removed replica's address: its per-address state goes
        self.replicas: list[Replica] = []
        self._task: asyncio.Task[None] | None = None
        self._draining: dict[asyncio.Future[None], grpc.aio.Channel] = {}
        self._any_up: bool | None = None
        self.listeners: list[Callable[[], object]] = []
        """Called whenever a replica registers, leaves, changes health or model state: requests held for
        a wake (services/router/balancer/wake.py) look again at once."""

    async def start(self) -> None:
        """Open the channels, probe every replica once, then keep polling in the background."""
        for address, tier in self._addresses:
            self.replicas.append(self._replica(address, tier))
        await self.probe_all()
        self._task = asyncio.create_task(self._poll(), name="router-health-poll")

    def _replica(self, address: str, tier: TierName) -> Replica:
        channel = grpc.aio.insecure_channel(address, options=grpc_options())
        return Replica(
            address,
            tier,
            channel,
            worker_pb2_grpc.WorkerStub(channel),
            readmit_s=self._readmit,
            kv_high_watermark=self._kv_high,
        )

    def apply_report(self, replica: Replica, report: WorkerReport) -> None:
        """Take ``report`` as ``replica``'s current load (pushed or pulled, the latest wins)."""
        changed = report.model_state is not replica.report.model_state
        if changed:
            log.info("worker_model_state", worker=report.worker_id or replica.name, state=report.model_state.value)
        replica.report = report
        replica.reported_at = time.monotonic()
        replica.worker_id = report.worker_id or replica.worker_id
        replica.active_sequences, replica.queue_depth = report.active, report.queued
        replica.max_active = report.max_active or replica.max_active
        if report.block_tokens == self._block_tokens and report.model_version in self._model_versions:
            replica.hot_blocks = frozenset(report.hot_blocks)
            if self._on_report is not None:
                self._on_report(replica)
        else:
            replica.hot_blocks = frozenset()
            if report.hot_blocks and replica.address not in self._mismatch_warned:
                self._mismatch_warned.add(replica.address)
                log.warning(
                    "worker_prefix_blocks_ignored",
                    worker=replica.name,
                    worker_block_tokens=report.block_tokens,
                    router_block_tokens=self._block_tokens,
                    worker_model_version=report.model_version,
                    router_model_version=self._model_version,
                    fix="give the worker and the router the same prefix_block_tokens and prepared model",
                )
        if changed:
            self.signal()

    def signal(self) -> None:
        """Tell the listeners that the replicas changed (see :attr:`listeners`)."""
        for listener in self.listeners:
            listener()

    async def wake(self, replica: Replica, timeout_s: float) -> None:
        """Ask ``replica`` to load its model (``Worker.Wake``; one load for every caller). Returns once it
        answers awake (its report says so at once); cancelling the call cancels this caller's share of the
        load (the worker goes back to sleep when nobody else waits). ResourceExhausted: the host is short of
        memory; Unavailable: the load failed or the worker did not answer."""
        meta = ((md.INTERNAL_TOKEN, self._token),)
        try:
            reply = await replica.stub.Wake(worker_pb2.WakeRequest(), timeout=timeout_s, metadata=meta)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc, Upstream.WORKER)
            raise error if isinstance(error, ResourceExhausted) else Unavailable(error.message) from None
        self._set_state(replica, model_state(reply.model_state), reply.resident_bytes)

    async def sleep(self, replica: Replica, timeout_s: float) -> bool:
        """Ask ``replica`` to release its model if it is idle (``Worker.Sleep(only_if_idle=True)``). False:
        it is busy (FAILED_PRECONDITION) or cannot sleep (a worker without Sleep); MeshError when it failed."""
        meta = ((md.INTERNAL_TOKEN, self._token),)
        try:
            reply = await replica.stub.Sleep(
                worker_pb2.SleepRequest(only_if_idle=True), timeout=timeout_s, metadata=meta
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                return False
            error: MeshError = from_rpc_error(exc, Upstream.WORKER)
            raise error from None
        self._set_state(replica, model_state(reply.model_state), reply.resident_bytes)
        return True

    def _set_state(self, replica: Replica, state: ModelState, resident_bytes: int) -> None:
        """What a Sleep or Wake answer says, taken at once (a static worker's next Stats probe may be 1 s away)."""
        report = replace(
            replica.report, model_state=state, resident_bytes=resident_bytes or replica.report.resident_bytes
        )
        self.apply_report(replica, report)

    async def heartbeat(
        self, address: str, tier: TierName, report: WorkerReport | None = None, *, leaving: bool = False
    ) -> float:
        """Register or refresh a self-registered worker; returns the TTL in seconds."""
        now = time.monotonic()
        replica = next((r for r in self.replicas if r.address == address), None)
        if replica is None:
            if leaving:
                return self.heartbeat_ttl_s
            if len(self.replicas) >= self.max_replicas:
                raise ResourceExhausted(
                    f"the router already has {self.max_replicas} workers (MESHSERVE_ROUTER_MAX_REPLICAS); "
                    f"{address} can register once one leaves",
                    int(self.heartbeat_ttl_s * 1000),
                )
            replica = self._replica(address, tier)
            replica.registered_until = now + self.heartbeat_ttl_s
            self.replicas.append(replica)
            worker = report.worker_id if report else ""
            log.info("worker_registered", address=address, tier=tier.value, worker=worker or address)
            await self._probe(replica)
            self._notify()
        elif replica.registered_until:
            replica.registered_until = now + self.heartbeat_ttl_s
        if report is not None:
            self.apply_report(replica, report)
        if leaving:
            replica.healthy = False  # a static replica only goes down; a registered one is dropped
            if replica.registered_until:
                self._drop(replica, "leaving")
            self._notify()
        return self.heartbeat_ttl_s

    def _drop(self, replica: Replica, reason: str) -> None:
        log.info("worker_deregistered", address=replica.address, worker=replica.name, reason=reason)
        self.replicas.remove(replica)
        replica.healthy = False
        self._mismatch_warned.discard(replica.address)
        if self._on_drop is not None:
            self._on_drop(replica.address)
        # Streams still running on a draining worker finish; a dead worker's fail on their own.
        task = asyncio.ensure_future(replica.channel.close(grace=self._drain_s))
        self._draining[task] = replica.channel
        task.add_done_callback(lambda t: self._draining.pop(t, None))

    def _expire(self) -> None:
        now = time.monotonic()
        for r in [r for r in self.replicas if 0 < r.registered_until < now]:
            self._drop(r, "heartbeat_expired")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for r in self.replicas:
            await r.channel.close()
        for channel in list(self._draining.values()):  # the router stops: no more grace
            await channel.close()
        if self._draining:
            await asyncio.wait(list(self._draining), timeout=1.0)

    def tiers(self) -> set[TierName]:
        """Tiers that have replicas configured (healthy or not)."""
        return {r.tier for r in self.replicas}

    def healthy(self, tier: TierName) -> list[Replica]:
        """The routable replicas of ``tier``: healthy and awake (:attr:`Replica.routable`)."""
        return [r for r in self.replicas if r.tier is tier and r.routable]

    def healthy_tiers(self) -> set[TierName]:
        """Tiers with a healthy replica, awake or not (an asleep one serves once woken)."""
        return {r.tier for r in self.replicas if r.healthy}

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Eject ``replica`` (it failed or stalled) with exponential backoff; see the module doc."""
        if replica.healthy:
            replica.ejections += 1
            backoff = min(self._eject_max, self._eject_base * 2 ** (replica.ejections - 1))
            replica.ejected_until = time.monotonic() + backoff
            EJECTIONS.labels(replica.tier.value, reason).inc()
            log.warning(
                "worker_ejected", worker=replica.name, address=replica.address, reason=reason, backoff_s=backoff
            )
        replica.healthy = False
        replica.failures += 1
        self._notify()

    async def probe_all(self) -> None:
        """Probe every replica now (the background loop calls this every interval)."""
        self._expire()
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
                self.apply_report(r, WorkerReport.from_pb(stats))
            r.probe_timeouts = 0
        except grpc.aio.AioRpcError as exc:
            up = False
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # A slow answer is not a dead worker: a busy one (a long prefill on a loaded machine)
                # keeps its place until several probes in a row time out. Refused connections,
                # NOT_SERVING and stalled streams still take it out at once.
                r.probe_timeouts += 1
                up = r.healthy and r.probe_timeouts < self._timeouts_to_down
            if r.healthy and not up:
                log.warning("worker_probe_failed", worker=r.name, address=r.address, code=exc.code().name)
        now = time.monotonic()
        if up and not r.healthy and now < r.ejected_until:
            up = False  # still ejected: wait out the backoff
        if up != r.healthy:
            log.info("worker_health_changed", worker=r.name, address=r.address, tier=r.tier.value, up=up)
            if up and r.ejections:
                r.readmitted_at = now
        elif up and r.ejections and r.readmitted_at and now - r.readmitted_at > self._readmit:
            r.ejections = 0
            r.readmitted_at = 0.0
        r.healthy = up

    def _notify(self) -> None:
        self.signal()
        any_up = any(r.healthy for r in self.replicas)
        if any_up != self._any_up:
            self._any_up = any_up
            if self._on_change is not None:
                self._on_change(any_up)
