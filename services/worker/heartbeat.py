"""Self-registration: the worker heartbeats its address, tier and load report to each router.

One task per router (``WorkerRegistry.Heartbeat``, internal credential from
``services.common.interceptors.outbound_metadata``). With ``resolve``, each ``host:port`` is a DNS
name re-resolved every ``interval_s`` (e.g. a Kubernetes headless Service, which lists every router
replica): the worker heartbeats to every address it resolves to, starts on addresses that appear and
stops on ones that are gone, so every router replica knows every worker. A failed or empty
resolution keeps the last known set. Contract:

* heartbeats never block serving: they run in their own tasks, each call bounded by
  ``timeout_s``; the report is built off the event loop (:class:`LoadReporter`);
* the period is ``interval_s``, shortened to a third of the TTL the router answers with, so two
  lost heartbeats in a row do not get the worker forgotten;
* a failed call is retried after an exponential backoff (``interval_s`` doubling, capped at
  ``max_backoff_s``, 2 s); the state (registered / unreachable) is logged once per change, not per
  call. The channel's own reconnect backoff is capped likewise (:data:`RECONNECT_OPTIONS`; gRPC's
  default grows to 120 s): a router restarted on its port (``meshserve up`` restarts a crashed one,
  services/local/supervise.py) hears from every worker within ~2 s of serving again, and it serves
  only once one has registered;
* :meth:`Heartbeater.beat_now` sends the next heartbeat to every router at once instead of after
  the period (the model fell asleep or woke: services/worker/sleep.py);
* :meth:`Heartbeater.leave` (graceful shutdown) cancels the loops and sends one last heartbeat with
  ``leaving`` set, so routers stop sending new work at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog

from services.common.interceptors import outbound_metadata
from services.common.pb.meshserve.internal.v1 import registry_pb2, registry_pb2_grpc, worker_pb2
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.serving import grpc_options

RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]
"""Reconnect backoff of the heartbeat channels: at most 2 s between attempts to reach a router."""


def _options() -> list[tuple[str, int]]:
    return [*grpc_options(), *RECONNECT_OPTIONS]


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
        max_backoff_s: float = 2.0,
        resolve: bool = False,
        resolver: Callable[[str], Awaitable[list[str]]] | None = None,
    ) -> None:
        self.names = list(routers)
        """Configured router addresses (``host:port``); with ``resolve``, DNS names to re-resolve."""
        self.resolve = resolve
        self._resolver = resolver or dns_addresses
        self.routers: list[str] = [] if resolve else list(routers)
        """Addresses heartbeated to now (the resolved ones with ``resolve``)."""
        self.address = address
        self.tier = tier
        self._stats = stats
        self._token = internal_token
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self._channels = {r: grpc.aio.insecure_channel(r, options=_options()) for r in self.routers}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._discovery: asyncio.Task[None] | None = None
        self._retired: set[asyncio.Task[None]] = set()
        self.registered: dict[str, bool] = {}
        """Per router: did the last heartbeat succeed (for tests and health pages)."""
        self.beats: dict[str, int] = dict.fromkeys(self.routers, 0)
        """Per router: heartbeats answered."""
        self._changed = asyncio.Event()
        self._resolve_failing = False
        self._kicks: dict[str, asyncio.Event] = {}

    def start(self) -> None:
        if self.resolve:
            self._discovery = asyncio.create_task(self._discover(), name="heartbeat-discovery")
            return
        for router in self.routers:
            self._add(router)

    def _add(self, router: str) -> None:
        if router not in self._channels:
            self._channels[router] = grpc.aio.insecure_channel(router, options=_options())
        self.beats.setdefault(router, 0)
        self._tasks[router] = asyncio.create_task(self._loop(router), name=f"heartbeat-{router}")

    async def _discover(self) -> None:
        """Re-resolve the router names every ``interval_s`` and heartbeat to exactly what they list."""
        while True:
            found = await self.resolve_routers()
            if found:
                for gone in [r for r in self.routers if r not in found]:
                    log.info("router_address_gone", router=gone, address=self.address)
                    task = self._tasks.pop(gone)
                    task.cancel()
                    self._retired.add(task)
                    task.add_done_callback(self._retired.discard)
                    self.registered.pop(gone, None)
                    self.beats.pop(gone, None)
                    await self._channels.pop(gone).close()
                for new in [r for r in found if r not in self.routers]:
                    log.info("router_address_found", router=new, address=self.address)
                    self._add(new)
                self.routers = found
                self._changed.set()
            await asyncio.sleep(self.interval_s)

    async def resolve_routers(self) -> list[str]:
        """Every ``ip:port`` the configured names resolve to now (sorted); empty when none resolve."""
        found: set[str] = set()
        failures = []
        for name in self.names:
            try:
                found.update(await self._resolver(name))
            except Exception as exc:  # NXDOMAIN, resolver down, a malformed answer: keep what we know
                failures.append(f"{name}: {exc}")
        failing = bool(failures) and not found
        if failing != self._resolve_failing:  # logged once per change, not every round
            self._resolve_failing = failing
            if failing:
                log.warning("router_names_not_resolved", names=self.names, errors=failures)
            else:
                log.info("router_names_resolved", names=self.names, routers=sorted(found))
        return sorted(found)

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
                await self._pause(router, backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            self.beats[router] += 1
            self._state(router, True, ttl_s=ttl)
            backoff = self.interval_s
            await self._pause(router, min(self.interval_s, ttl / 3) if ttl > 0 else self.interval_s)

    async def _pause(self, router: str, delay_s: float) -> None:
        """Until the next heartbeat to ``router``: ``delay_s``, or sooner after :meth:`beat_now`."""
        kick = self._kicks.setdefault(router, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(kick.wait(), delay_s)
        kick.clear()

    def beat_now(self) -> None:
        """Send the next heartbeat to every router now (the load report changed in a way that matters:
        the model fell asleep or woke). A beat in flight is followed by another one."""
        for router in self.routers:
            self._kicks.setdefault(router, asyncio.Event()).set()

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

    async def wait_routers(self, count: int) -> None:
        """Until at least ``count`` routers answered a heartbeat (with ``resolve``: resolved ones)."""
        while sum(self.registered.get(r, False) for r in self.routers) < count:
            self._changed.clear()
            await self._changed.wait()

    async def stop(self) -> None:
        """Stop heartbeating without a goodbye (routers forget this worker after their TTL)."""
        tasks = [*self._tasks.values(), *self._retired, *([self._discovery] if self._discovery else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._discovery = None

    async def leave(self) -> None:
        """Stop heartbeating and tell every router this worker is leaving (best effort, bounded)."""
        await self.stop()
        routers = [r for r in self.routers if r in self._channels]
        results = await asyncio.gather(*(self._beat(r, leaving=True) for r in routers), return_exceptions=True)
        for router, result in zip(routers, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("worker_leave_not_delivered", router=router, error=_describe(result))
            else:
                log.info("worker_left_router", router=router, address=self.address)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


async def dns_addresses(name: str) -> list[str]:
    """The ``ip:port`` addresses ``host:port`` resolves to (off the event loop; OSError when none)."""
    host, _, port = name.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    found = []
    for info in infos:
        ip = str(info[4][0])
        address = f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"
        if address not in found:
            found.append(address)
    return found


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__
