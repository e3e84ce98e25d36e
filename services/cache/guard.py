"""Fail-open access to Redis shared by every cache: timeout per call, circuit breaker, counters.

``await guard.run(op, factory)`` returns the call's result, :data:`FAILED` when Redis is down or
slow (over ``timeout_s``), or :data:`SKIPPED` when the breaker is open (or no Redis is configured).
The timeout is the client's own socket timeout when the client was built with ``timeout_s`` as its
read timeout (``client_timeout=True``: no timer of ours per call, which costs as much as a small GET's
parsing); calls that pass their own ``timeout_s`` (large KV transfers) get an ``asyncio.timeout``.
Nothing here raises on a Redis problem. Counters of lookups/stores by kind and result go to
Prometheus and, every ``stats_flush_s``, to the Redis hash keys.STATS_KEY in the background, so
`meshserve cache stats` sees every process's hit ratio without a write on the request path.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import structlog
from prometheus_client import Counter
from redis.exceptions import RedisError

from services.cache.breaker import CircuitBreaker, State
from services.cache.connection import AnyRedis
from services.cache.keys import STATS_KEY

log = structlog.get_logger(__name__)
T = TypeVar("T")

CACHE_LOOKUPS = Counter(
    "meshserve_cache_lookups_total",
    "Cache lookups by cache kind and result (hit, miss, error, corrupt, skipped).",
    ["service", "kind", "result"],
)
CACHE_STORES = Counter(
    "meshserve_cache_stores_total",
    "Cache writes by cache kind and result (stored, too_large, over_budget, error, skipped).",
    ["service", "kind", "result"],
)


class Failed:
    """Type of the FAILED / SKIPPED markers."""

    def __repr__(self) -> str:
        return "FAILED"


FAILED: Final = Failed()
"""Redis was called and failed (error or timeout)."""
SKIPPED: Final = Failed()
"""Redis was not called: no client, or the circuit breaker is open."""
REDIS_ERRORS = (RedisError, OSError, TimeoutError)


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
        self._pending: Tally[str] = Tally()
        self._last_flush = time.monotonic()
        self._flush_task: asyncio.Task[None] | None = None
        self._children: dict[tuple[str, str, bool], tuple[str, Counter]] = {}

    @property
    def enabled(self) -> bool:
        return self.client is not None

    async def run(
        self, op: str, factory: Callable[[AnyRedis], Awaitable[T]], timeout_s: float | None = None
    ) -> T | Failed:
        """Run ``factory(client)`` under the timeout and breaker; FAILED/SKIPPED, never a Redis error."""
        breaker = self.breaker
        if self.client is None or not breaker.allow():
            return SKIPPED
        try:
            if timeout_s is None and self.client_timeout:
                result = await factory(self.client)
            else:
                async with asyncio.timeout(timeout_s or self.timeout_s):
                    result = await factory(self.client)
        except REDIS_ERRORS as exc:
            was = breaker.state
            breaker.failure()
            if breaker.state != was:
                log.warning("cache_breaker_open", op=op, error=type(exc).__name__, state=breaker.state.value)
            return FAILED
        if breaker.failures or breaker.state is not State.CLOSED:
            log.info("cache_breaker_closed", op=op)
            breaker.success()
        return result

    def count(self, kind: str, result: str, n: int = 1, *, store: bool = False) -> None:
        """Count ``n`` lookups (or stores) of ``kind`` with ``result``."""
        cached = self._children.get((kind, result, store))
        if cached is None:
            child = (CACHE_STORES if store else CACHE_LOOKUPS).labels(self.service, kind, result)
            cached = (f"{kind}:{'store' if store else 'lookup'}:{result}", child)
            self._children[(kind, result, store)] = cached
        name, child = cached
        child.inc(n)
        self.tally[name] += n
        self._pending[name] += n
        now = time.monotonic()
        if now - self._last_flush >= self.stats_flush_s and self._flush_task is None and self.client is not None:
            self._last_flush = now
            self._flush_task = asyncio.get_running_loop().create_task(self.flush_stats())

    async def flush_stats(self) -> None:
        """Add the counts since the last flush to the shared stats hash (kept on failure)."""
        pending, self._pending = self._pending, Tally()
        try:
            if pending:

                async def write(c: AnyRedis) -> None:
                    pipe = c.pipeline(transaction=False)
                    for name, n in pending.items():
                        pipe.hincrby(STATS_KEY, name, n)
                    await pipe.execute()

                if isinstance(await self.run("stats", write), Failed):
                    self._pending.update(pending)
        finally:
            self._flush_task = None

    async def close(self) -> None:
        if self._flush_task is not None:
            await self._flush_task
        if self.client is not None:
            await self.flush_stats()
            await self.client.aclose()
