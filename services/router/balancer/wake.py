"""Scale from zero in the router: requests held while a model version wakes, and the idle sweeper.

One :class:`Waker` per model version (per :class:`~services.router.balancer.core.Router`):

- **Holding.** A request for a version with no awake replica (:meth:`Waker.hold`, before the replica
  choice; again before a retry or a resume, without the replica that failed) waits, bounded in count
  (``max_held``: one more is refused with ResourceExhausted) and in time (``deadline_s``, or the
  request's own deadline if sooner: then Unavailable with a retry-after, naming the model). It is
  held only when waiting can help: a healthy replica of the version is asleep, falling asleep or
  waking, or (``min_replicas`` 0) none runs at all and the local scaler or KEDA starts one on
  ``meshserve_router_held_requests``. Otherwise the request path fails at once as before.
- **One wake per version.** The first held request starts the one wake task; every request held
  meanwhile waits on it. It wakes an asleep replica (healthy first, the most recently reported first);
  a failed wake tries the next, and when none is left every held request fails with Unavailable and a
  retry-after (the host short of memory says so). A replica that is already waking (woken by another
  router, or by a turn that reached it) is waited for, not woken again; one that registers asleep is
  woken. The registry's listeners (:meth:`Waker.notify`) end the wait as soon as a replica is awake.
- **No wake for nobody.** A held request that goes away (cancelled) leaves the count; when the last one
  has gone, the wake task is cancelled, which cancels the Wake RPC: the worker goes back to sleep after
  its load (services/worker: the last cancelled caller of a load).
- **Idle.** :class:`IdleSweeper` (started and stopped with the router server) calls :meth:`Waker.sweep`
  about every second: it exports the idle time and the replicas by state, and once ``idle_after_s`` has
  passed since the version's last request with nothing held or in flight, it asks the awake replicas
  beyond ``min_replicas`` to sleep (``Sleep(only_if_idle)``: a busy worker refuses, and is asked again
  :data:`SLEEP_RETRY_S` later). The idle clock is this router's, but work the replicas report that this router did
  not send (another router replica's: running or queued sequences, prompt tokens counted since the last
  sweep) restarts it too, so one router does not put to sleep a version another one keeps busy.

Held requests keep their place in the normal path: after the hold they go through admission
(services/router/balancer/slo_queue.py) with their priority and tenant like any request, and a stream stays a
stream. The Sleep and Wake calls are the registry's (it holds the stubs); this module knows no gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Collection, Sequence

import structlog

from services.common.errors import MeshError, ResourceExhausted, Unavailable
from services.common.model_state import ModelState
from services.router.balancer.registry import Replica
from services.router.config import IdleSpec
from services.router.metrics import HELD, HELD_TIMEOUTS, IDLE_SECONDS, MODEL_REPLICAS, WAKE_SECONDS, WAKES

log = structlog.get_logger(__name__)

RETRY_AFTER_S = 5
"""What a held request that timed out, or whose wake failed, is told to wait before it retries."""
SLEEP_TIMEOUT_S = 30.0
"""Longest wait for a worker's answer to Sleep (it releases its model before it answers)."""
SLEEP_RETRY_S = 5.0
"""A replica that refused to sleep (busy, or an engine that cannot) is asked again after this long, not on
every sweep."""
_NOT_AWAKE = (ModelState.ASLEEP, ModelState.FALLING_ASLEEP)

WakeCall = Callable[[Replica, float], Awaitable[None]]
"""Wake a replica within the timeout (the registry's ``wake``): ResourceExhausted when its host is short
of memory, another MeshError when the load failed; returns once the replica reports awake."""
SleepCall = Callable[[Replica, float], Awaitable[bool]]
"""Ask a replica to sleep if idle (the registry's ``sleep``): False when it is busy."""


def version_state(replicas: Sequence[Replica]) -> str:
    """What ListModels says of a version: ``awake`` if a healthy replica is awake, else ``waking``, else
    ``asleep``, else ``stopped`` (configured, no replica running)."""
    states = {r.state for r in replicas if r.healthy}
    if ModelState.AWAKE in states:
        return "awake"
    if ModelState.WAKING in states:
        return "waking"
    if states & set(_NOT_AWAKE):
        return "asleep"
    return "stopped"


class Waker:
    """Holding, the one wake and the idle policy of one model version (see the module docstring)."""

    def __init__(
        self,
        *,
        model: str,
        version: str,
        replicas: Callable[[], Sequence[Replica]],
        wake: WakeCall,
        sleep: SleepCall,
        idle: IdleSpec,
        deadline_s: float = 60.0,
        max_held: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.version = version
        self._replicas = replicas
        self._wake_call = wake
        self._sleep_call = sleep
        self.idle = idle
        self.deadline_s = deadline_s
        self.max_held = max_held
        self._clock = clock
        self.last_request = clock()
        """When the version's last request started or ended (the router's start before the first)."""
        self.held = 0
        """Requests held now."""
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._sleeping: set[Replica] = set()
        self._sleeps: set[asyncio.Task[None]] = set()
        self._seen: dict[Replica, int] = {}
        self._refused: dict[Replica, float] = {}  # replica -> when it last refused or failed to sleep
        self._held_gauge = HELD.labels(model, version)
        self._held_gauge.set(0)
        self._idle_gauge = IDLE_SECONDS.labels(model, version)
        self._timeouts = HELD_TIMEOUTS.labels(model, version)
        self._wake_seconds = WAKE_SECONDS.labels(model, version)
        self._by_state = {s: MODEL_REPLICAS.labels(model, version, s) for s in ("awake", "waking", "asleep")}

    def notify(self) -> None:
        """The replicas changed (a registry listener): held requests look again now."""
        self._changed.set()
        self._changed = asyncio.Event()

    def touch(self) -> None:
        """A request of this version starts or ends: the idle clock starts again."""
        self.last_request = self._clock()

    def ready(self) -> bool:
        """A replica of the version is healthy and awake."""
        return any(r.routable for r in self._replicas())

    def must_hold(self, exclude: Collection[Replica] = ()) -> bool:
        """No replica is awake (apart from ``exclude``: those a turn failed on) and waiting can help (see
        the module docstring)."""
        replicas = [r for r in self._replicas() if r not in exclude]
        if any(r.routable for r in replicas):
            return False
        if any(r.healthy and r.state is not ModelState.AWAKE for r in replicas):
            return True
        return self.idle.min_replicas == 0 and not any(r.healthy for r in replicas)

    async def hold(self, timeout_s: float | None = None, exclude: Collection[Replica] = ()) -> None:
        """Return once a replica of the version (not in ``exclude``) is awake, or at once when holding
        cannot help (the request path then refuses as for any version without a healthy replica).
        ResourceExhausted: ``max_held`` requests are held already; Unavailable (with a retry-after): no
        replica woke within the wake deadline (or ``timeout_s``, the request's own, if sooner), or the
        wake failed on every replica."""
        if not self.must_hold(exclude):
            return
        retry_ms = RETRY_AFTER_S * 1000
        if self.held >= self.max_held:
            raise ResourceExhausted(
                f"model {self.model!r} is waking up and already holds {self.max_held} requests "
                f"(MESHSERVE_ROUTER_MAX_HELD_PER_MODEL); retry after {RETRY_AFTER_S} s",
                retry_ms,
            )
        loop = asyncio.get_running_loop()
        wait_s = self.deadline_s if timeout_s is None else min(self.deadline_s, timeout_s)
        until = loop.time() + wait_s
        self.held += 1
        self._held_gauge.inc()
        if self.held == 1:
            log.info("requests_held", model=self.model, version=self.version)
        try:
            while self.must_hold(exclude):
                if (failure := self._failure()) is not None:
                    raise failure
                self._start_wake()
                left = until - loop.time()
                if left <= 0:
                    self._timeouts.inc()
                    log.warning("held_request_timed_out", model=self.model, version=self.version, waited_s=wait_s)
                    raise Unavailable(
                        f"model {self.model!r} is waking up and did not become ready within "
                        f"{math.ceil(wait_s)} s; retry after {RETRY_AFTER_S} s",
                        retry_ms,
                    )
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, 1.0))
        finally:
            self.held -= 1
            self._held_gauge.dec()
            if self.held == 0:
                self._abandon()

    def _failure(self) -> MeshError | None:
        """The error of a wake that ended failing, for every request held while it ran."""
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        error = task.exception()
        if error is None:
            self._task = None  # it woke one, which is no longer awake: another wake may start
            return None
        return error if isinstance(error, MeshError) else Unavailable(str(error))

    def _candidates(self) -> list[Replica]:
        asleep = [r for r in self._replicas() if r.state in _NOT_AWAKE]
        return sorted(asleep, key=lambda r: (not r.healthy, -r.reported_at))

    def _start_wake(self) -> None:
        if self._task is not None:
            return
        if any(r.healthy and r.state is ModelState.WAKING for r in self._replicas()):
            return  # woken by someone else (another router, a turn that reached it): wait for it
        if not self._candidates():
            return  # none runs: wait for one to register
        self._task = asyncio.create_task(self._wake(), name=f"wake-{self.model}-{self.version}")
        self._task.add_done_callback(lambda _: self.notify())

    async def _wake(self) -> None:
        tried: set[Replica] = set()
        error: MeshError = Unavailable(
            f"model {self.model!r} has no replica left to wake; retry after {RETRY_AFTER_S} s", RETRY_AFTER_S * 1000
        )
        while candidates := [r for r in self._candidates() if r not in tried]:
            replica = candidates[0]
            tried.add(replica)
            log.info("model_waking", model=self.model, version=self.version, worker=replica.name)
            started = time.perf_counter()
            try:
                await self._wake_call(replica, self.deadline_s)
            except ResourceExhausted:
                WAKES.labels(self.model, self.version, "no_memory").inc()
                log.warning(
                    "model_wake_failed", model=self.model, version=self.version, worker=replica.name, why="no_memory"
                )
                error = Unavailable(
                    f"model {self.model!r} could not wake up: the host of its worker is short of memory; "
                    f"free memory or add a worker, and retry after {RETRY_AFTER_S} s",
                    RETRY_AFTER_S * 1000,
                )
            except MeshError as exc:
                WAKES.labels(self.model, self.version, "failed").inc()
                log.warning(
                    "model_wake_failed", model=self.model, version=self.version, worker=replica.name, why=exc.message
                )
                error = Unavailable(
                    f"model {self.model!r} could not wake up: loading it failed; retry after {RETRY_AFTER_S} s",
                    RETRY_AFTER_S * 1000,
                )
            else:
                seconds = time.perf_counter() - started
                WAKES.labels(self.model, self.version, "ok").inc()
                self._wake_seconds.observe(seconds)
                log.info(
                    "model_woke", model=self.model, version=self.version, worker=replica.name, seconds=round(seconds, 3)
                )
                return
        raise error

    def _abandon(self) -> None:
        """Nobody is held any more: a wake still running is for nobody, so it stops."""
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():
            task.cancel()
            WAKES.labels(self.model, self.version, "abandoned").inc()
            log.info("model_wake_abandoned", model=self.model, version=self.version)
        elif not task.cancelled():
            task.exception()  # retrieved: its failure was told to the held requests

    def sweep(self) -> None:
        """One round of the idle policy (see the module docstring); the sleeps run as tasks of their own."""
        replicas = self._replicas()
        if self._busy_elsewhere(replicas):
            self.touch()
        idle_s = self._clock() - self.last_request
        self._idle_gauge.set(idle_s)
        counts = dict.fromkeys(self._by_state, 0)
        for r in replicas:
            state = r.state
            counts["awake" if state is ModelState.AWAKE else "waking" if state is ModelState.WAKING else "asleep"] += 1
        for name, gauge in self._by_state.items():
            gauge.set(counts[name])
        after = self.idle.idle_after_s
        if after is None or idle_s < after or self.held or any(r.in_flight for r in replicas):
            return
        now = self._clock()
        self._refused = {r: t for r, t in self._refused.items() if r in replicas and now - t < SLEEP_RETRY_S}
        awake = sorted((r for r in replicas if r.routable), key=lambda r: r.address)
        for replica in awake[self.idle.min_replicas :]:
            if replica not in self._sleeping and replica not in self._refused:
                task = asyncio.create_task(self._sleep(replica, idle_s), name=f"sleep-{replica.name}")
                self._sleeps.add(task)
                task.add_done_callback(self._sleeps.discard)

    def _busy_elsewhere(self, replicas: Sequence[Replica]) -> bool:
        """Whether the replicas' own reports show work this router did not send (another router's, or a
        gateway's embedded one): sequences running or queued, or prompt tokens counted since the last sweep.
        Such a version is not idle, even if this router saw no request."""
        seen, self._seen = self._seen, {r: r.report.prompt_tokens_total for r in replicas}
        return any(
            r.report.active + r.report.queued > r.in_flight or (r in seen and r.report.prompt_tokens_total != seen[r])
            for r in replicas
        )

    async def _sleep(self, replica: Replica, idle_s: float) -> None:
        self._sleeping.add(replica)
        try:
            slept = await self._sleep_call(replica, SLEEP_TIMEOUT_S)
        except MeshError as exc:
            self._refused[replica] = self._clock()
            log.warning(
                "model_sleep_failed", model=self.model, version=self.version, worker=replica.name, why=exc.message
            )
        else:
            if slept:
                log.info(
                    "model_asleep", model=self.model, version=self.version, worker=replica.name, idle_s=round(idle_s, 1)
                )
            else:
                self._refused[replica] = self._clock()
        finally:
            self._sleeping.discard(replica)

    async def close(self) -> None:
        """Cancel the wake and the sleeps still running (the router stops)."""
        tasks = [*self._sleeps, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._task = None


class IdleSweeper:
    """Runs every :class:`Waker`'s :meth:`~Waker.sweep` about every ``interval_s`` (one task per router)."""

    def __init__(self, wakers: Sequence[Waker], interval_s: float = 1.0) -> None:
        self._wakers = list(wakers)
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="router-idle-sweeper")

    async def _run(self) -> None:
        while True:
            for waker in self._wakers:
                try:
                    waker.sweep()
                except Exception:  # the sweeper must survive anything; the next round retries
                    log.exception("idle_sweep_failed", model=waker.model, version=waker.version)
            await asyncio.sleep(self._interval)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for waker in self._wakers:
            await waker.close()
