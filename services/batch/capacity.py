"""The "free capacity only" throttle: a batch line may start only while the workers have room.

Every ``poll_s`` the runner reads each router's replica view (``RouterAdmin.ListReplicas``, what
``meshserve status`` shows). A replica's used slots are the larger of what this router has in
flight to it and what the worker last reported running or queued (other routers' work included);
across routers the largest view of each replica wins. A line may start when

* this runner runs fewer than ``max_in_flight`` lines,
* no healthy replica has a queue, and
* the free slots of the healthy replicas, less the lines started since the last view, are more than
  ``reserve_slots``, which stay for interactive requests.

So batch work fills only slots that interactive traffic leaves idle, and an interactive burst finds
``reserve_slots`` free slots at once and the rest as batch lines end (a line is short: it is one
request). Lines also run at priority 0, the lowest class, so a batch line waiting in the router's
queue is served after any waiting interactive request of a higher class.

When no router answers the view (a router too old to serve it, say), the runner runs one line at a
time rather than guess. The view is read only while a line waits or runs: an idle runner asks the
routers nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog

from services.common.pb.meshserve.internal.v1 import router_admin_pb2, router_admin_pb2_grpc

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class View:
    free_slots: int
    queued: int
    replicas: int


def combine(replies: Sequence[router_admin_pb2.ListReplicasResponse]) -> View:
    """The free slots and queue of the healthy replicas over every router's view."""
    used: dict[str, int] = {}
    size: dict[str, int] = {}
    queued: dict[str, int] = {}
    for reply in replies:
        for r in reply.replicas:
            if not r.healthy or r.kv_full:
                continue
            key = r.worker_id or r.address
            used[key] = max(used.get(key, 0), r.in_flight, r.active_sequences + r.queue_depth)
            size[key] = max(size.get(key, 0), r.max_active_sequences)
            queued[key] = max(queued.get(key, 0), r.queue_depth)
    free = sum(max(0, size[k] - used[k]) for k in size)
    return View(free_slots=free, queued=sum(queued.values()), replicas=len(size))


class Capacity:
    """Grants line starts (see the module docstring). ``acquire``/``release`` bracket each line."""

    def __init__(
        self,
        admins: Sequence[router_admin_pb2_grpc.RouterAdminStub],
        metadata: tuple[tuple[str, str], ...],
        *,
        max_in_flight: int,
        reserve_slots: int,
        poll_s: float,
    ) -> None:
        self._admins = admins
        self._metadata = metadata
        self._max = max_in_flight
        self._reserve = reserve_slots
        self._poll_s = poll_s
        self.in_flight = 0
        self._started = 0
        self._started_since_view = 0
        self._view: View | None = None
        self._viewed = False  # a view (or the lack of one) newer than the last idle time
        self._waiting = 0
        self._wanted = asyncio.Event()
        self._changed = asyncio.Condition()
        self._warned = False

    async def poll_forever(self) -> None:
        """Read the view every ``poll_s`` while a line waits or runs; an idle runner asks nothing of the
        routers (and its next line waits for a fresh view)."""
        while True:
            await self._wanted.wait()
            asked_at = self._started  # lines started before the view was asked for are in it
            view = await self._read()
            async with self._changed:
                self._view = view
                self._viewed = True
                self._started_since_view = self._started - asked_at
                self._changed.notify_all()
            await asyncio.sleep(self._poll_s)
            if self.in_flight == 0 and self._waiting == 0:
                self._wanted.clear()
                self._viewed = False

    async def _read(self) -> View | None:
        replies = []
        for admin in self._admins:
            try:
                replies.append(
                    await admin.ListReplicas(
                        router_admin_pb2.ListReplicasRequest(), metadata=self._metadata, timeout=self._poll_s * 5 + 1
                    )
                )
            except grpc.aio.AioRpcError as exc:
                if not self._warned:
                    log.warning("batch_capacity_unknown", code=exc.code().name, detail=exc.details())
                    self._warned = True
        return combine(replies) if replies else None

    def _may_start(self) -> bool:
        if self.in_flight >= self._max or not self._viewed:
            return False
        view = self._view
        if view is None:  # no view: one line at a time
            return self.in_flight == 0
        return view.queued == 0 and view.free_slots - self._started_since_view > self._reserve

    async def acquire(self) -> None:
        async with self._changed:
            self._waiting += 1
            self._wanted.set()
            try:
                await self._changed.wait_for(self._may_start)
            finally:
                self._waiting -= 1
            self.in_flight += 1
            self._started += 1
            self._started_since_view += 1

    async def release(self) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()
