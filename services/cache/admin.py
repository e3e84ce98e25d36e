"""Cache administration (no transport): stats by kind, flush by tenant/model/version, warm-up.

* Stats: lookup/store counters every cache user flushes into keys.STATS_KEY (guard.py), entry and
  value-byte counts by SCAN + STRLEN (bounded by ``max_keys``), and Redis' memory figures and policy.
* Flush: SCAN MATCH over the hash-tagged namespace (keys.scan_pattern) + UNLINK in batches; the
  ledgers of a flushed scope go with it. Chosen over generation numbers in keys because it costs no
  extra read on the request path and frees memory at once; the SCAN walks the keyspace, which is
  fine for an admin action (docs/cache.md).
* Warm: shared system prompts are sent through the router once as deterministic, shareable
  requests, so the shared response entry (and, once workers export KV, the shared prefix blocks)
  exist before users arrive. The call to the router is passed in (servicer side), keeping gRPC out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import structlog

from services.store.connection import AnyRedis
from services.store.keys import NAMESPACE, STATS_KEY, Kind, scan_pattern

log = structlog.get_logger(__name__)
KIND_NAMES = {Kind.RESPONSE: "response", Kind.KV: "kv"}
_RESULT_FIELD = {"hit": "hits", "miss": "misses", "error": "errors"}
_SCAN_COUNT = 1000
_UNLINK_BATCH = 500


@dataclass
class KindStats:
    """Hit/miss/store counters of one cache kind (response or KV), as the cache service reports them."""

    kind: str
    hits: int = 0
    misses: int = 0
    errors: int = 0
    corrupt: int = 0
    skipped: int = 0
    stored: int = 0
    too_large: int = 0
    over_budget: int = 0
    entries: int = 0
    bytes: int = 0
    scopes: int = 0

    @property
    def hit_ratio(self) -> float:
        lookups = self.hits + self.misses + self.errors + self.corrupt + self.skipped
        return self.hits / lookups if lookups else 0.0


@dataclass
class Stats:
    """Every kind's counters plus Redis' memory use and eviction policy."""

    kinds: dict[str, KindStats] = field(default_factory=dict)
    used_memory: int = 0
    maxmemory: int = 0
    maxmemory_policy: str = ""


@dataclass(frozen=True)
class FlushFilter:
    """Which entries to flush; at least one filter, or ``everything``."""

    kind: Kind | None = None
    model_id: str | None = None
    model_version: str | None = None
    tenant: str | None = None
    shared: bool = False
    everything: bool = False

    def check(self) -> None:
        if not (self.everything or self.model_id or self.model_version or self.tenant or self.shared):
            raise ValueError("name a tenant, a model, a model version or shared entries to flush (or ask for all)")
        if self.tenant and self.shared:
            raise ValueError("flush either one tenant's entries or the shared ones, not both")


@dataclass(frozen=True)
class WarmLimits:
    """Bounds of one Warm call: each prompt is a real generation request through the router."""

    timeout_s: float = 120.0
    max_prompts: int = 64
    max_tokens: int = 256

    def check(self, prompts: Sequence[str], max_tokens: int) -> None:
        if not prompts:
            raise ValueError("give at least one non-empty prompt to warm")
        if len(prompts) > self.max_prompts:
            given = len(prompts)
            raise ValueError(f"give at most {self.max_prompts} prompts per warm call ({given} given); split the list")
        if max_tokens > self.max_tokens:
            raise ValueError(f"max_tokens of a warm call is at most {self.max_tokens} ({max_tokens} given)")


Generate = Callable[[str, int, float], Awaitable[None]]
"""Sends one prompt through the router as a deterministic, shareable request of ``max_tokens``, within
``timeout_s`` seconds."""


class CacheAdmin:
    """Stats, flushes and warm-up of the caches in one Redis (what the cache service's RPCs run)."""

    def __init__(self, client: AnyRedis, *, max_keys: int = 1_000_000) -> None:
        self.client = client
        self.max_keys = max_keys

    async def stats(self) -> Stats:
        out = Stats(kinds={name: KindStats(name) for name in KIND_NAMES.values()})
        counters = await self.client.hgetall(STATS_KEY)  # type: ignore[misc]
        for raw_name, raw_value in counters.items():
            kind, op, result = _text(raw_name).split(":", 2)
            if op == "store" and result in ("error", "skipped"):
                continue  # failed writes are not lookups; the Prometheus counters have them
            result = _RESULT_FIELD.get(result, result)
            ks = out.kinds.get(kind)
            if ks is not None and hasattr(ks, result):
                setattr(ks, result, getattr(ks, result) + int(raw_value))
        for kind, name in KIND_NAMES.items():
            await self._count_entries(kind, out.kinds[name])
        info = await self.client.info("memory")
        for node_info in _per_node(info):
            out.used_memory += int(str(node_info.get("used_memory", 0)))
            out.maxmemory += int(str(node_info.get("maxmemory", 0)))
            out.maxmemory_policy = str(node_info.get("maxmemory_policy", out.maxmemory_policy))
        return out

    async def _count_entries(self, kind: Kind, ks: KindStats) -> None:
        """Entries, value bytes (STRLEN, pipelined) and scopes of one kind, up to ``max_keys``."""
        tags: set[str] = set()
        batch: list[str] = []
        async for key in self.client.scan_iter(match=scan_pattern(kind, suffix="e:*"), count=_SCAN_COUNT):
            text = _text(key)
            batch.append(text)
            tags.add(text.split("}", 1)[0])
            if len(batch) >= _UNLINK_BATCH:
                ks.bytes += await self._strlen(batch)
                ks.entries += len(batch)
                batch = []
            if ks.entries + len(batch) >= self.max_keys:
                log.warning("cache_stats_truncated", kind=ks.kind, max_keys=self.max_keys)
                break
        if batch:
            ks.bytes += await self._strlen(batch)
            ks.entries += len(batch)
        ks.scopes = len(tags)

    async def _strlen(self, keys: list[str]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        return sum(int(n) for n in await pipe.execute())

    async def flush(self, what: FlushFilter) -> int:
        """UNLINK every key of the matching scopes (entries and ledgers); returns how many."""
        what.check()
        if what.everything:
            pattern = f"{NAMESPACE}:{{[rk]|*"
        else:
            pattern = scan_pattern(what.kind, what.model_id, what.model_version, what.tenant, what.shared, suffix="*")
        deleted = 0
        batch: list[str] = []
        async for key in self.client.scan_iter(match=pattern, count=_SCAN_COUNT):
            batch.append(_text(key))
            if len(batch) >= _UNLINK_BATCH:
                deleted += await self._unlink(batch)
                batch = []
        if batch:
            deleted += await self._unlink(batch)
        log.info("cache_flushed", pattern=pattern, keys=deleted)
        return deleted

    async def _unlink(self, keys: list[str]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.unlink(key)
        return sum(int(n) for n in await pipe.execute())

    @staticmethod
    async def warm(
        prompts: Sequence[str], max_tokens: int, generate: Generate, limits: WarmLimits, deadline: float | None
    ) -> tuple[int, int]:
        """Send each prompt once; returns (warmed, failed). A failed prompt does not stop the rest.

        Each request gets ``limits.timeout_s``, cut to what is left before ``deadline`` (``time.monotonic``,
        the caller's deadline; ``None``: none); prompts still unsent when it has passed count as failed.
        """
        warmed = failed = unsent = 0
        for prompt in prompts:
            left = math.inf if deadline is None else deadline - time.monotonic()
            if left <= 0:
                unsent += 1
                continue
            try:
                await generate(prompt, max_tokens, min(limits.timeout_s, left))
                warmed += 1
            except Exception as exc:  # reported per prompt; the rest still warm
                failed += 1
                log.warning("cache_warm_failed", error=type(exc).__name__)
        if unsent:
            log.warning("cache_warm_deadline_passed", warmed=warmed, failed=failed, unsent=unsent)
        return warmed, failed + unsent


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _per_node(info: dict[str, object]) -> list[dict[str, object]]:
    """INFO of one server, or of every node of a cluster (redis-py returns a dict per node)."""
    if info and all(isinstance(v, dict) for v in info.values()):
        return [v for v in info.values() if isinstance(v, dict)]
    return [info]
