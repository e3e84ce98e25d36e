"""The local scaler of ``meshserve up``: the stop policy of the idle policy (docs/deploy.md, *Scale from zero*).

A model version whose idle policy has ``min_replicas: 0`` and ``stop_after_s`` (its own ``idle:``, else
its model's, as the routers apply them) loses its worker processes once the routers have seen no
request for it that long, and gets one back as soon as a request for it is held. Each version is its
own pool when the mesh knows which workers serve which version (``meshserve up --edge-version``): a
canary that nobody calls stops while the stable version serves, and a request held for the canary
starts the canary's worker. Otherwise the model is one pool over all its versions. The routers say
both in their Prometheus metrics (the same gauges KEDA reads on Kubernetes):

- ``meshserve_router_idle_seconds{model,version}``: seconds since the version's last request. A pool
  is idle for the smallest value over its versions and over every router (each gateway replica has
  its own router and sees only its own requests);
- ``meshserve_router_held_requests{model,version}``: requests waiting for a replica, summed.

:class:`Scaler` is the policy alone, over text and a :class:`Workers` interface, so it tests with fakes;
:func:`run` polls the routers' metrics endpoints over HTTP and feeds it. Starting and stopping go
through the supervisor (services/local/supervise.py, ``Supervisor.stop_service``/``start_service``),
which does not restart a worker stopped on purpose and shows it as ``stopped (idle)`` in the state
file (``meshserve status``). A started worker registers with the routers by heartbeat, and the requests
they hold go to it.

Bounds: one start or stop at a time per pool. From zero, the first worker starts as soon as a request
is held (the held requests go to it); the model's other stopped workers (the other tier, the other
replicas: a stop ends all of them) follow one at a time while the model stays in use (a request held,
or idle for less than ``stop_after_s``), so a start from zero gives back the mesh that was stopped, not
one worker of it. A failed start is logged and
tried again after a backoff (:class:`Backoff`: 0.5 s doubling to 8 s), while requests stay held (the
routers' wake deadline ends them with 503 + Retry-After if no start succeeds).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from prometheus_client.parser import text_string_to_metric_families

from services.common.processes import LogSink
from services.local.supervise import Supervisor

HELD = "meshserve_router_held_requests"
IDLE = "meshserve_router_idle_seconds"
SCALER = "scaler"
"""The name the scaler's log lines carry in the merged log."""


@dataclass(frozen=True)
class StopPolicy:
    """One pool's stop policy: an idle policy with ``min_replicas: 0`` and ``stop_after_s`` set."""

    model: str
    stop_after_s: float
    workers: tuple[str, ...]
    """The supervised worker processes of the pool, in the order they are started from zero."""
    version: str | None = None
    """The version the workers serve (its own signals); None: the model's, whatever the version."""

    @property
    def pool(self) -> str:
        """How logs and tasks name the pool: ``model`` or ``model@version``."""
        return self.model if self.version is None else f"{self.model}@{self.version}"

    @property
    def labels(self) -> dict[str, str]:
        """The model (and version) a scale event is about."""
        return {"model": self.model} if self.version is None else {"model": self.model, "version": self.version}


@dataclass(frozen=True)
class ModelSignal:
    """What the routers say of one model (over its versions) or of one version, over every router."""

    held: float = 0.0
    idle_s: float | None = None
    """None: no router exports it (yet): the scaler then stops nothing."""
    versions: Mapping[str, ModelSignal] = field(default_factory=dict, compare=False)
    """The model's signal per version (empty for a version's own)."""

    def of(self, version: str | None) -> ModelSignal:
        """The signal of ``version`` (none heard: no news), or the model's own for None."""
        return self if version is None else self.versions.get(version, ModelSignal())


def read_signals(texts: Iterable[str]) -> dict[str, ModelSignal]:
    """Model -> its held requests (summed) and idle seconds (the least) from Prometheus exposition texts,
    one per router, over its versions and per version (:meth:`ModelSignal.of`). A text that does not
    parse is skipped (a router restarting mid-scrape)."""
    held: dict[tuple[str, str], float] = {}
    idle: dict[tuple[str, str], float] = {}
    for text in texts:
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for family in families:
            for sample in family.samples:
                model = sample.labels.get("model")
                if model is None or math.isnan(sample.value):
                    continue
                key = (model, sample.labels.get("version", ""))
                if sample.name == HELD:
                    held[key] = held.get(key, 0.0) + sample.value
                elif sample.name == IDLE:
                    idle[key] = min(idle.get(key, math.inf), sample.value)
    per_version: dict[str, dict[str, ModelSignal]] = {}
    for model, version in {*held, *idle}:
        key = (model, version)
        per_version.setdefault(model, {})[version] = ModelSignal(held=held.get(key, 0.0), idle_s=idle.get(key))
    out = {}
    for model, versions in per_version.items():
        idles = [v.idle_s for v in versions.values() if v.idle_s is not None]
        out[model] = ModelSignal(
            held=sum(v.held for v in versions.values()), idle_s=min(idles) if idles else None, versions=versions
        )
    return out


class Workers(Protocol):
    """Starts and stops supervised worker processes (the supervisor; a fake in tests)."""

    def is_running(self, name: str) -> bool:
        """Up (or being started): a replica the routers have or are about to get."""

    def is_stopped(self, name: str) -> bool:
        """Stopped on purpose by :meth:`stop`, not started since."""

    async def stop(self, name: str) -> bool:
        """Stop ``name`` on purpose; False when it was not running (nothing done)."""

    async def start(self, name: str) -> None:
        """Start ``name`` again and wait until it serves; raises when it does not."""


@dataclass(frozen=True)
class Backoff:
    """Delay before trying a start again after ``failures`` failed ones in a row."""

    base_s: float = 0.5
    cap_s: float = 8.0

    def delay_s(self, failures: int) -> float:
        return min(self.cap_s, self.base_s * 2 ** max(0, failures - 1))


@dataclass
class _Pool:
    policy: StopPolicy
    busy: asyncio.Task[None] | None = None
    """The start or stop under way (one at a time per model)."""
    failures: int = 0
    retry_at: float = 0.0
    """Monotonic time before which no start is tried (after a failed one)."""
    started_at: float = -math.inf
    """Monotonic time the scaler last started one of its workers: none is stopped for idle within
    ``stop_after_s`` of it, whatever a router's gauge still says."""


class Scaler:
    """Decides, per pool with a stop policy, to stop its workers or start one; :meth:`tick` once per
    poll. Starts and stops run as tasks, so a slow start (a model load) never delays a poll."""

    def __init__(
        self,
        policies: Sequence[StopPolicy],
        workers: Workers,
        *,
        log: Any,
        backoff: Backoff | None = None,
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workers = workers
        self.clock = clock
        self.log = log
        self.backoff = backoff or Backoff()
        self.on_change = on_change
        self._pools = {p.pool: _Pool(p) for p in policies if p.workers}
        self.events: list[dict[str, object]] = []
        """Every scale event so far (also logged), newest last; bounded to the last 100."""

    @property
    def policies(self) -> list[StopPolicy]:
        return [pool.policy for pool in self._pools.values()]

    def busy(self, pool: str) -> bool:
        """A start or stop of ``pool`` (:attr:`StopPolicy.pool`) is under way."""
        task = self._pools[pool].busy
        return task is not None and not task.done()

    def tick(self, signals: Mapping[str, ModelSignal]) -> None:
        """One decision per pool from the routers' latest ``signals`` (model -> signal)."""
        now = self.clock()
        for name, pool in self._pools.items():
            if self.busy(name):
                continue
            signal = signals.get(pool.policy.model, ModelSignal()).of(pool.policy.version)
            names = pool.policy.workers
            running = [n for n in names if self.workers.is_running(n)]
            stopped = [n for n in names if self.workers.is_stopped(n)]  # a crashed one is the restart policy's
            in_use = signal.held > 0 or (signal.idle_s is not None and signal.idle_s < pool.policy.stop_after_s)
            if signal.held > 0 and not running:
                if now >= pool.retry_at and stopped:
                    start = self._start(pool, stopped[0], signal, "scale_from_zero")
                    pool.busy = asyncio.create_task(start, name=f"scale-up-{name}")
            elif running and stopped and in_use and now >= pool.retry_at:
                # The first worker serves the held requests; the rest of what was stopped (the other
                # tier, the other replicas) comes back while the model is in use, one at a time.
                start = self._start(pool, stopped[0], signal, "scale_up")
                pool.busy = asyncio.create_task(start, name=f"scale-up-{name}")
            elif (
                running
                and signal.held <= 0
                and signal.idle_s is not None
                and signal.idle_s >= pool.policy.stop_after_s
                and now - pool.started_at >= pool.policy.stop_after_s
            ):
                pool.busy = asyncio.create_task(self._stop(pool, running, signal), name=f"scale-down-{name}")

    async def close(self) -> None:
        """Cancel the starts and stops under way (the mesh is stopping)."""
        tasks = [p.busy for p in self._pools.values() if p.busy is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _event(self, event: str, level: str, **values: object) -> None:
        getattr(self.log, level)(event, **values)
        at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.events.append({"event": event, "at": at, **values})
        del self.events[:-100]
        if self.on_change is not None:
            self.on_change()

    async def _stop(self, pool: _Pool, names: list[str], signal: ModelSignal) -> None:
        done = await asyncio.gather(*(self.workers.stop(n) for n in names))  # each drains: side by side
        stopped = [n for n, ok in zip(names, done, strict=True) if ok]
        if stopped:
            self._event(
                "scale_to_zero",
                "info",
                **pool.policy.labels,
                workers=stopped,
                idle_s=round(signal.idle_s or 0.0, 1),
                stop_after_s=pool.policy.stop_after_s,
            )

    async def _start(self, pool: _Pool, name: str, signal: ModelSignal, event: str) -> None:
        """Start ``name``; ``event`` is ``scale_from_zero`` (none ran) or ``scale_up`` (the rest of the
        stopped workers); its ``_failed`` and ``_done`` events follow."""
        self._event(event, "info", **pool.policy.labels, worker=name, held_requests=int(signal.held))
        began = self.clock()
        try:
            await self.workers.start(name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure to come up: try again later, requests stay held
            pool.failures += 1
            delay = self.backoff.delay_s(pool.failures)
            pool.retry_at = self.clock() + delay
            error = " ".join(str(exc).split()) or type(exc).__name__
            self._event(
                f"{event}_failed",
                "error",
                **pool.policy.labels,
                worker=name,
                error=error,
                failures=pool.failures,
                retry_in_s=delay,
            )
            return
        pool.failures = 0
        pool.retry_at = 0.0
        pool.started_at = self.clock()
        took = round(self.clock() - began, 2)
        self._event(f"{event}_done", "info", **pool.policy.labels, worker=name, start_s=took)


def sink_logger(sink: LogSink, name: str = SCALER) -> Any:
    """A structlog logger whose JSON lines go to the mesh's merged log under ``name``."""

    class _SinkWriter:
        def msg(self, message: str) -> None:
            sink(name, message)

        debug = info = warning = error = critical = msg

    return structlog.wrap_logger(
        _SinkWriter(),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
    )


WorkerMap = Mapping[str, Mapping[str | None, Sequence[str]]]
"""Model id -> version name -> the worker processes serving it here, in start order; the version None:
workers of the model whose version the mesh does not tell apart."""


def stop_policies(models: Mapping[str, Any], workers: WorkerMap) -> list[StopPolicy]:
    """The stop policies of a models file's content (``idle: {min_replicas: 0, stop_after_s: S}``;
    docs/router.md), for the models that have workers here: one per version that has its own workers
    (its ``idle:``, else its model's: the routers' rule, ``RouterSettings.idle_for``), and one for the
    model's other workers (the model's ``idle:``)."""
    policies = []
    for spec in models.get("models") or ():
        model = spec.get("id")
        by_version = workers.get(model) or {}
        version_idle = {v.get("name"): v.get("idle") for v in spec.get("versions") or ()}
        for version, names in by_version.items():
            idle = (version_idle.get(version) if version is not None else None) or spec.get("idle") or {}
            stop_after = idle.get("stop_after_s")
            if idle.get("min_replicas", 1) == 0 and stop_after is not None and names:
                policies.append(StopPolicy(model, float(stop_after), tuple(names), version))
    return policies


async def _scrape(session: Any, urls: Iterable[str]) -> list[str]:
    import aiohttp

    async def one(url: str) -> str | None:
        try:
            async with session.get(url) as response:
                return str(await response.text())
        except (aiohttp.ClientError, TimeoutError):
            return None  # a router restarting: the others (or the next poll) tell

    texts = await asyncio.gather(*(one(u) for u in urls))
    return [t for t in texts if t is not None]


async def run(scaler: Scaler, router_metrics: Callable[[], Iterable[str]], interval_s: float = 0.5) -> None:
    """Poll the routers' metrics every ``interval_s`` and let ``scaler`` act, until cancelled.
    ``router_metrics`` gives the current URLs (a restarted router serves them on a new port)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=2.0)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                texts = await _scrape(session, list(router_metrics()))
                if texts:  # no router answered: decide nothing on no news
                    scaler.tick(read_signals(texts))
                await asyncio.sleep(interval_s)  # the poll period, not a readiness wait
    finally:
        with contextlib.suppress(Exception):
            await scaler.close()


class SupervisedWorkers:
    """:class:`Workers` over ``meshserve up``'s supervisor: stopped on purpose as ``stopped (idle)``."""

    def __init__(self, supervisor: Supervisor, grace_s: float = 15.0) -> None:
        self.supervisor = supervisor
        self.grace_s = grace_s

    def is_running(self, name: str) -> bool:
        return self.supervisor.is_running(name)

    def is_stopped(self, name: str) -> bool:
        return self.supervisor.is_stopped(name)

    async def stop(self, name: str) -> bool:
        return await self.supervisor.stop_service(name, "idle", self.grace_s)

    async def start(self, name: str) -> None:
        await self.supervisor.start_service(name)
