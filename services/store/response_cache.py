"""Response cache on Redis: exact-match entries, TTL, size and byte budgets, fail-open access.

Keys come from keys.response_key (tenant-salted unless shareable), values from codec.py. A get is
one GET; a put is one pipeline (SET + the byte-ledger script, ledger.py). Redis down, slow or
returning garbage never fails a request: ``get`` returns None (a miss), ``put`` returns False;
corrupt or unknown-format values are counted and ignored. Timeouts and the circuit breaker live in
guard.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from services.store.breaker import CircuitBreaker
from services.store.connection import AnyRedis, redis_from_url
from services.store.guard import FAILED, SKIPPED, Failed, Guard
from services.store.ledger import put_entries
from services.store.response_codec import CachedResponse, CorruptEntry, Finish, decode_response, encode_response

log = structlog.get_logger(__name__)
KIND = "response"

__all__ = ["CacheStats", "CachedResponse", "CorruptEntry", "Finish", "ResponseCache"]


@dataclass
class CacheStats:
    """Counters of one ResponseCache (also exported as Prometheus metrics)."""

    hits: int = 0
    misses: int = 0
    errors: int = 0
    corrupt: int = 0
    stored: int = 0
    too_large: int = 0
    skipped_while_down: int = 0


@dataclass
class ResponseCache:
    """Fail-open response cache. ``guard.client is None`` means disabled (every get is a miss)."""

    guard: Guard
    ttl_s: int = 3600
    max_entry_bytes: int = 1 << 20
    budget_bytes: int = 0
    """Most value bytes one scope (model version x tenant salt) may hold, oldest entries going first;
    0 = no per-scope ledger: entries are bounded by TTL, ``max_entry_bytes`` and Redis maxmemory, and
    a put is a bare ``SET EX`` (the ledger costs a script per put, docs/benchmarks/cache.md)."""
    stats: CacheStats = field(default_factory=CacheStats)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout_s: float = 0.05,
        retry_after_s: float = 1.0,
        service: str = "unknown",
        **kwargs: object,
    ) -> ResponseCache:
        """A cache on ``url`` (see connection.py for the schemes); empty url = disabled cache.

        ``retry_after_s`` is how long the circuit breaker stays open after Redis failed; each failed
        probe doubles it, up to 4 x ``retry_after_s``.
        """
        # No socket read timeout: the guard's watchdog bounds every call without a timer per call.
        client = redis_from_url(url, timeout_s) if url else None
        breaker = CircuitBreaker(failure_threshold=1, reset_s=retry_after_s, max_reset_s=4 * retry_after_s)
        guard = Guard(client, timeout_s=timeout_s, breaker=breaker, service=service)
        return cls(guard, **kwargs)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        return self.guard.enabled

    @property
    def client(self) -> object:
        return self.guard.client

    async def get(self, key: str) -> CachedResponse | None:
        """The cached response under ``key``, or None (miss, Redis unavailable, corrupt value)."""
        data = await self.guard.run("get", lambda c: c.get(key))
        if isinstance(data, Failed):
            self.stats.misses += 1
            if data is FAILED:
                self.stats.errors += 1
                self.guard.count(KIND, "error")
            elif self.enabled:
                self.stats.skipped_while_down += 1
                self.guard.count(KIND, "skipped")
            return None
        if data is None:
            self.stats.misses += 1
            self.guard.count(KIND, "miss")
            return None
        try:
            resp = decode_response(data)  # type: ignore[arg-type]
        except CorruptEntry as exc:
            self.stats.corrupt += 1
            self.guard.count(KIND, "corrupt")
            log.warning("cache_corrupt_entry", kind=KIND, error=str(exc))
            return None
        self.stats.hits += 1
        self.guard.count(KIND, "hit")
        return resp

    async def put(self, key: str, resp: CachedResponse) -> bool:
        """Store ``resp`` under ``key`` with the TTL; False when skipped (too large, Redis down)."""
        if not self.enabled:
            return False
        data = encode_response(resp)
        if len(data) > self.max_entry_bytes or 0 < self.budget_bytes < len(data):
            self.stats.too_large += 1
            self.guard.count(KIND, "too_large", store=True)
            return False
        if self.budget_bytes:
            result = await self.guard.run(
                "put", lambda c: put_entries(c, (key,), (data,), self.ttl_s, self.budget_bytes)
            )
        else:
            result = await self.guard.run("put", lambda c: _set(c, key, data, self.ttl_s))
        if result is SKIPPED:
            self.guard.count(KIND, "skipped", store=True)
            return False
        if result is FAILED:
            self.stats.errors += 1
            self.guard.count(KIND, "error", store=True)
            return False
        stored = bool(result[0])  # type: ignore[index]
        self.stats.stored += stored
        self.guard.count(KIND, "stored" if stored else "over_budget", store=True)
        return stored

    async def delete(self, key: str) -> bool:
        """Remove one entry; False when it did not exist or Redis is unavailable."""
        result = await self.guard.run("delete", lambda c: c.unlink(key))
        return not isinstance(result, Failed) and bool(result)

    async def close(self) -> None:
        await self.guard.close()


async def _set(client: AnyRedis, key: str, data: bytes, ttl_s: int) -> tuple[int, int]:
    await client.set(key, data, ex=ttl_s)
    return 1, 0
