"""Fail-open access to Redis shared by every cache: timeout per call, circuit breaker, counters.

``await guard.run(op, factory)`` returns the call's result, :data:`FAILED` when Redis is down or
slow (over ``timeout_s``), or :data:`SKIPPED` when the breaker is open (or no Redis is configured).
Nothing here raises on a Redis problem.

Timeouts: a timer per call (``asyncio.timeout``, or redis-py's socket timeout, which arms a Task and
two timers per command) costs about as much CPU as all of our own work on a small GET
(docs/benchmarks/cache.md). So calls register a deadline in a dict and one watchdog task per guard,
awake only while calls are in flight, cancels those past their deadline every quarter of the
shortest timeout: a call is abandoned between its timeout and 1.25 x it (an abandoned redis-py
command closes its connection). A client built with its own read timeout can say so
(``client_timeout=True``) and is then not watched.

Counters of lookups/stores by kind and result are plain dict increments on the request path: they
reach Prometheus through a collector that reads them at scrape time, and, every ``stats_flush_s``,
the Redis hash keys.STATS_KEY in the background, so `meshserve cache stats` sees every process's hit
ratio without a write on the request path.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterator
from typing import Final, TypeVar

import structlog
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from services.store.breaker import CircuitBreaker, State
from services.store.connection import AnyRedis
from services.store.keys import STATS_KEY

log = structlog.get_logger(__name__)
T = TypeVar("T")
_current_task = asyncio.current_task


class Failed:
    """Type of the FAILED / SKIPPED markers."""

    def __repr__(self) -> str:
        return "FAILED"


FAILED: Final = Failed()
"""Redis was called and failed (error or timeout)."""
SKIPPED: Final = Failed()
"""Redis was not called: no client, or the circuit breaker is open."""
REDIS_ERRORS = (RedisError, OSError, TimeoutError)


class _Counts(Collector):
    """meshserve_cache_{lookups,stores}_total from the tallies of every Guard of the process."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[str, Tally[str]]] = {}
        self.retired: Tally[tuple[str, str]] = Tally()

    def add(self, guard: Guard) -> None:
        self.live[id(guard)] = (guard.service, guard.tally)
        weakref.finalize(guard, self._retire, id(guard))

    def _retire(self, ident: int) -> None:
        service, tally = self.live.pop(ident)
        self.retired.update({(service, name): n for name, n in tally.items()})

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The two families with no samples: lets the registry (and the dashboard tests) know them."""
        yield from self._families().values()

    @staticmethod
    def _families() -> dict[str, CounterMetricFamily]:
        return {
            "lookup": CounterMetricFamily(
                "meshserve_cache_lookups",
                "Cache lookups by cache kind and result (hit, miss, error, corrupt, skipped).",
                labels=["service", "kind", "result"],
            ),
            "store": CounterMetricFamily(
                "meshserve_cache_stores",
                "Cache writes by cache kind and result (stored, too_large, over_budget, error, skipped).",
                labels=["service", "kind", "result"],
            ),
        }

    def collect(self) -> Iterator[CounterMetricFamily]:
        totals = Tally(self.retired)
        for service, tally in list(self.live.values()):
            totals.update({(service, name): n for name, n in tally.items()})
        families = self._families()
        for (service, name), n in sorted(totals.items()):
            kind, op, result = name.split(":", 2)
            families[op].add_metric([service, kind, result], n)
        yield from families.values()


COUNTS: Final = _Counts()
REGISTRY.register(COUNTS)


class Guard:
    """One Redis client with a timeout, a breaker and counters (shared by the caches of a process)."""

    def __init__(
        self,
        client: AnyRedis | None,
        *,
        timeout_s: float = 0.05,
        breaker: CircuitBreaker | None = None,
        service: str = "unknown",
        stats_flush_s: float = 2.0,
        client_timeout: bool = False,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.client_timeout = client_timeout
        """True when ``client`` itself times out reads after ``timeout_s`` (its socket timeout)."""
        self.breaker = breaker or CircuitBreaker()
        self.service = service
        self.stats_flush_s = stats_flush_s
        self.tally: Tally[str] = Tally()
        """Counts since start by ``<kind>:<lookup|store>:<result>``."""
        self._flushed: Tally[str] = Tally()
        self._names: dict[tuple[str, str, bool], str] = {}
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self._inflight: dict[asyncio.Task[object], list[float]] = {}
        """Task -> [deadline, cancelling() at entry, 1.0 once the watchdog cancelled it]."""
        self._watchdog: asyncio.Task[None] | None = None
        self._shortest = timeout_s
        """The shortest timeout of any call so far: the watchdog wakes every quarter of it."""
        COUNTS.add(self)

    @property
    def enabled(self) -> bool:
        return self.client is not None

    async def run(
        self, op: str, factory: Callable[[AnyRedis], Awaitable[T]], timeout_s: float | None = None
    ) -> T | Failed:
        """Run ``factory(client)`` under the timeout and breaker; FAILED/SKIPPED, never a Redis error."""
        client = self.client
        breaker = self.breaker
        if client is None or not breaker.allow():
            return SKIPPED
        if self.client_timeout and timeout_s is None:
            try:
                result = await factory(client)
            except REDIS_ERRORS as exc:
                return self._failed(op, exc)
            except asyncio.CancelledError:
                breaker.abandon()
                raise
        else:
            task = _current_task()
            if task is None:  # like asyncio.timeout: cancelling needs a task
                raise RuntimeError("Guard.run must be awaited inside an asyncio task")
            loop = task.get_loop()
            limit = timeout_s or self.timeout_s
            watch = [loop.time() + limit, task.cancelling(), 0.0]
            self._inflight[task] = watch  # type: ignore[index]
            dog = self._watchdog
            if dog is None or dog.done() or dog.get_loop() is not loop or limit < self._shortest:
                self._restart_watchdog(loop, limit)
            try:
                result = await factory(client)
            except REDIS_ERRORS as exc:
                return self._failed(op, exc)
            except asyncio.CancelledError:
                if watch[2] and task.uncancel() <= watch[1]:
                    return self._failed(op, TimeoutError())
                breaker.abandon()  # a half-open probe cancelled from outside must not block the next
                raise
            finally:
                del self._inflight[task]  # type: ignore[arg-type]
        if breaker.failures or breaker.state is not State.CLOSED:
            log.info("cache_breaker_closed", op=op)
            breaker.success()
        return result

    def _failed(self, op: str, exc: BaseException) -> Failed:
        breaker = self.breaker
        was = breaker.state
        breaker.failure()
        if breaker.state != was:
            log.warning("cache_breaker_open", op=op, error=type(exc).__name__, state=breaker.state.value)
        return FAILED

    def _restart_watchdog(self, loop: asyncio.AbstractEventLoop, limit: float) -> None:
        dog = self._watchdog
        if limit < self._shortest:  # a shorter per-call timeout than any so far: wake up more often
            self._shortest = limit
            if dog is not None and not dog.done() and dog.get_loop() is loop:
                dog.cancel()
        self._watchdog = loop.create_task(self._watch(), name="cache-guard-watchdog")

    async def _watch(self) -> None:
        """Cancel calls past their deadline; ends once no call is in flight."""
        inflight = self._inflight
        loop = asyncio.get_running_loop()
        while inflight:
            await asyncio.sleep(max(0.001, self._shortest / 4))
            now = loop.time()
            for task, watch in list(inflight.items()):
                if not watch[2] and now >= watch[0]:
                    watch[2] = 1.0
                    task.cancel()

    def count(self, kind: str, result: str, n: int = 1, *, store: bool = False) -> None:
        """Count ``n`` lookups (or stores) of ``kind`` with ``result``."""
        name = self._names.get((kind, result, store))
        if name is None:
            name = self._names[(kind, result, store)] = f"{kind}:{'store' if store else 'lookup'}:{result}"
        self.tally[name] += n
        if self._flush_timer is None and self._flush_task is None and self.client is not None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(self.stats_flush_s, self._start_flush, loop)

    def _start_flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self._flush_timer = None
        if self._flush_task is None:
            self._flush_task = loop.create_task(self.flush_stats())

    async def flush_stats(self) -> None:
        """Add the counts since the last flush to the shared stats hash (kept on failure)."""
        pending = self.tally - self._flushed
        try:
            if pending:

                async def write(c: AnyRedis) -> None:
                    pipe = c.pipeline(transaction=False)
                    for name, n in pending.items():
                        pipe.hincrby(STATS_KEY, name, n)
                    await pipe.execute()

                if not isinstance(await self.run("stats", write), Failed):
                    self._flushed.update(pending)
        finally:
            self._flush_task = None

    async def close(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        if self._flush_task is not None:
            await self._flush_task
        if self.client is not None:
            await self.flush_stats()
        dog = self._watchdog  # after the last guarded call: a cancelled watchdog watches nothing
        if dog is not None and not dog.done() and dog.get_loop() is asyncio.get_running_loop():
            dog.cancel()
        if self.client is not None:
            await self.client.aclose()
