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

A free slot is not free compute: on a CPU-bound tier every batch row in a worker's step, and every
batch prefill, slows the interactive turns beside it. So, with a :class:`Headroom` (the runner's
default), a line also needs the interactive work to be idle, measured from the same view: the
routers' turns in flight, less the background ones, are the interactive turns running now. The
routers count background turns apart (every runner's lines, marked ``RoutingOptions.background``),
so several runners never take each other's lines for interactive work; with a router that does not
count them, this runner's own calls are taken off instead.

* A line starts only after the routers have shown no interactive turn for ``quiet_s``.
* The number of lines may grow by one per quiet view (additive increase, up to ``max_in_flight``)
  and is halved by every view with interactive work (multiplicative decrease): a short idle gap
  starts one line, not ``max_in_flight``, and a long one ramps up to the full rate.
* No starvation: after ``max_defer_s`` without a start, one line may start alone even while
  interactive turns run (a load that never leaves the workers idle still sees its batch end).
* While the latest view shows interactive work the view is read every ``busy_poll_s`` instead of
  ``poll_s`` (no line may start then anyway; each read costs the router and this runner ~1 ms of CPU
  on the cores the interactive turns use). The part of such a gap beyond ``poll_s`` counts as busy,
  so a line still waits ``quiet_s`` as measured at ``poll_s``.

Lines already running are not stopped; a line is one request, so they end in a turn's time.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
    in_flight: int = 0
    """Turns the routers run now, on any replica: each router counts its own, so they add up."""
    background: int = 0
    """Of ``in_flight``, the background ones (every runner's batch lines, as the routers mark them)."""


def combine(replies: Sequence[router_admin_pb2.ListReplicasResponse]) -> View:
    """The free slots and queue of the healthy replicas over every router's view, and the routers' turns."""
    used: dict[str, int] = {}
    size: dict[str, int] = {}
    queued: dict[str, int] = {}
    in_flight = background = 0
    for reply in replies:
        for r in reply.replicas:
            in_flight += r.in_flight
            background += r.background_in_flight
            if not r.healthy or r.kv_full:
                continue
            key = r.worker_id or r.address
            used[key] = max(used.get(key, 0), r.in_flight, r.active_sequences + r.queue_depth)
            size[key] = max(size.get(key, 0), r.max_active_sequences)
            queued[key] = max(queued.get(key, 0), r.queue_depth)
    free = sum(max(0, size[k] - used[k]) for k in size)
    return View(
        free_slots=free, queued=sum(queued.values()), replicas=len(size), in_flight=in_flight, background=background
    )


class Headroom:
    """When interactive work leaves room for batch lines (see the module docstring); pure, the clock
    passed in. ``observe`` takes each view's count of interactive turns; ``allows`` says whether one
    more line may start with ``in_flight`` running."""

    def __init__(self, *, max_lines: int, quiet_s: float, max_defer_s: float, now: float) -> None:
        self.max_lines = max_lines
        self.quiet_s = quiet_s
        self.max_defer_s = max_defer_s
        self.limit = 1
        """Lines that may run now (AIMD, 1 to ``max_lines``)."""
        self.busy = False
        """The latest view showed interactive work."""
        self.busy_at = -math.inf
        """When interactive work was last seen."""
        self.started_at = now
        """When the last line started (the starvation clock; a new runner waits a full period too)."""

    def observe(self, interactive: int, now: float, unseen_s: float = 0.0) -> None:
        """``unseen_s``: the part of the time since the previous view that no view saw (read less often
        while busy): after a busy view, the work counts as running through it."""
        was_busy = self.busy
        self.busy = interactive > 0
        if self.busy:
            self.busy_at = now
            self.limit = max(1, self.limit // 2)
            return
        if was_busy and unseen_s > 0:  # busy_at is the previous view's time
            self.busy_at = min(now, self.busy_at + unseen_s)
        if self.quiet(now):
            self.limit = min(self.max_lines, self.limit + 1)

    def quiet(self, now: float) -> bool:
        """The latest view showed no interactive turn, nor any view of the last ``quiet_s``."""
        return not self.busy and now - self.busy_at >= self.quiet_s

    def allows(self, in_flight: int, now: float) -> bool:
        if self.quiet(now):
            return in_flight < self.limit
        return in_flight == 0 and now - self.started_at >= self.max_defer_s

    def started(self, now: float) -> None:
        self.started_at = now


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
        busy_poll_s: float | None = None,
        headroom: Headroom | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``headroom``: also wait for interactive work to be idle (None: free slots only);
        ``busy_poll_s``: the view's period while it shows interactive work (None: ``poll_s``)."""
        self._admins = admins
        self._metadata = metadata
        self._max = max_in_flight
        self._reserve = reserve_slots
        self._poll_s = poll_s
        self._busy_poll_s = max(poll_s, busy_poll_s or poll_s)
        self._viewed_at: float | None = None
        self.views = 0
        """Views read so far (one ListReplicas call per router each)."""
        self.in_flight = 0
        self._started = 0
        self._started_since_view = 0
        self._view: View | None = None
        self._viewed = False  # a view (or the lack of one) newer than the last idle time
        self._waiting = 0
        self._wanted = asyncio.Event()
        self._changed = asyncio.Condition()
        self._warned = False
        self._headroom = headroom
        self._clock = clock
        self.calling = 0
        """This runner's calls to the routers running now (their turns are in the routers' count)."""

    @contextmanager
    def call(self) -> Iterator[None]:
        """Bracket a line's router call, so the view's turns less these are the interactive ones."""
        self.calling += 1
        try:
            yield
        finally:
            self.calling -= 1

    async def poll_forever(self) -> None:
        """Read the view every ``poll_s`` while a line waits or runs; an idle runner asks nothing of the
        routers (and its next line waits for a fresh view)."""
        while True:
            await self._wanted.wait()
            asked_at = self._started  # lines started before the view was asked for are in it
            calling = self.calling
            view = await self._read()
            self.views += 1
            async with self._changed:
                if view is not None and self._headroom is not None:
                    # Background turns are every runner's lines (the routers count them apart); a router
                    # that does not count them: the fewer of our own calls, so that a call that ended
                    # meanwhile never hides an interactive turn (too many counted only delays a line).
                    ours = max(view.background, min(calling, self.calling))
                    now = self._clock()
                    unseen = 0.0 if self._viewed_at is None else now - self._viewed_at - self._poll_s
                    self._headroom.observe(max(0, view.in_flight - ours), now, max(0.0, unseen))
                    self._viewed_at = now
                self._view = view
                self._viewed = True
                self._started_since_view = self._started - asked_at
                self._changed.notify_all()
            busy = self._headroom is not None and self._headroom.busy
            await asyncio.sleep(self._busy_poll_s if busy else self._poll_s)
            if self.in_flight == 0 and self._waiting == 0:
                self._wanted.clear()
                self._viewed = False
                self._viewed_at = None

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
        if view.queued or view.free_slots - self._started_since_view <= self._reserve:
            return False
        return self._headroom is None or self._headroom.allows(self.in_flight, self._clock())

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
            if self._headroom is not None:
                self._headroom.started(self._clock())

    async def release(self) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()
