"""Response cache on Redis: value encoding, TTL and size policy, and fail-open access.

Value layout (version 1), no pickle::

    header  struct "<4sBBBBIIII": magic b"MSRC", format version, finish reason code, token width
            (2 or 4 bytes), reserved, token count, prompt tokens, completion tokens, text bytes
    tokens  token count x little-endian uint16/uint32
    text    UTF-8

Every Redis call has a short timeout. Redis down, slow or returning garbage never fails a request:
``get`` returns None (a miss) and ``put`` returns False; unknown or corrupt values are counted and
ignored. After a Redis error the cache stays off for ``retry_after_s`` so an outage costs one
timeout, not one per request; it comes back on its own.
"""

from __future__ import annotations

import asyncio
import struct
import time
from array import array
from dataclasses import dataclass, field
from enum import IntEnum

import redis.asyncio as aioredis
import structlog
from prometheus_client import Counter
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = structlog.get_logger(__name__)

CACHE_LOOKUPS = Counter(
    "meshserve_cache_lookups_total",
    "Cache lookups by cache kind and result (hit, miss, error, corrupt).",
    ["service", "kind", "result"],
)
CACHE_STORES = Counter(
    "meshserve_cache_stores_total",
    "Cache writes by cache kind and result (stored, too_large, error).",
    ["service", "kind", "result"],
)

MAGIC = b"MSRC"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBBBIIII")
_LITTLE = struct.pack("=H", 1) == struct.pack("<H", 1)


class Finish(IntEnum):
    """Finish reasons a cached response may carry (same numbers as meshserve.v1.FinishReason)."""

    STOP = 1
    LENGTH = 2
    STOP_STRING = 3


class CorruptEntry(ValueError):
    """A cached value that is not a valid entry of a format this code knows."""


@dataclass(frozen=True)
class CachedResponse:
    """A finished response as the cache stores it."""

    token_ids: tuple[int, ...]
    text: str
    finish: Finish
    prompt_tokens: int
    completion_tokens: int


def encode_response(resp: CachedResponse) -> bytes:
    width = 2 if all(0 <= t < 1 << 16 for t in resp.token_ids) else 4
    tokens = array("H" if width == 2 else "I", resp.token_ids)
    if tokens.itemsize != width:  # platforms where "I" is not 4 bytes
        raise ValueError("unsupported platform integer size")
    if not _LITTLE:
        tokens.byteswap()
    text = resp.text.encode()
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        int(resp.finish),
        width,
        0,
        len(tokens),
        resp.prompt_tokens,
        resp.completion_tokens,
        len(text),
    )
    return header + tokens.tobytes() + text


def decode_response(data: bytes) -> CachedResponse:
    """Parse a value written by :func:`encode_response`; raises :class:`CorruptEntry`."""
    if len(data) < _HEADER.size:
        raise CorruptEntry("value shorter than the header")
    magic, version, finish, width, _r, n, prompt, completion, text_len = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptEntry(f"unknown format {magic!r} v{version}")
    if width not in (2, 4):
        raise CorruptEntry(f"bad token width {width}")
    end_tokens = _HEADER.size + n * width
    if len(data) != end_tokens + text_len:
        raise CorruptEntry("length does not match the header")
    try:
        reason = Finish(finish)
        text = data[end_tokens:].decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptEntry(str(exc)) from None
    tokens = array("H" if width == 2 else "I")
    tokens.frombytes(data[_HEADER.size : end_tokens])
    if not _LITTLE:
        tokens.byteswap()
    return CachedResponse(tuple(tokens), text, reason, prompt, completion)


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
    """Fail-open response cache. ``client=None`` means disabled (every get is a miss)."""

    client: aioredis.Redis | None
    ttl_s: int = 3600
    max_entry_bytes: int = 1 << 20
    timeout_s: float = 0.05
    retry_after_s: float = 1.0
    service: str = "unknown"
    stats: CacheStats = field(default_factory=CacheStats)
    _down_until: float = field(default=0.0, init=False, repr=False)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 0.05, **kwargs: object) -> ResponseCache:
        """A cache on ``url`` (redis://, rediss://, unix://); empty url = disabled cache."""
        client = None
        if url:
            client = aioredis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),  # one try: a retry would only double the latency
            )
        return cls(client, timeout_s=timeout_s, **kwargs)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def _available(self) -> bool:
        return self.client is not None and time.monotonic() >= self._down_until

    def _failed(self, op: str, exc: BaseException) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.retry_after_s
        log.warning("cache_unavailable", op=op, error=type(exc).__name__, retry_after_s=self.retry_after_s)

    async def get(self, key: str) -> CachedResponse | None:
        """The cached response under ``key``, or None (miss, Redis unavailable, corrupt value)."""
        if not self._available():
            self.stats.misses += 1
            self.stats.skipped_while_down += self.client is not None
            CACHE_LOOKUPS.labels(self.service, "response", "miss").inc()
            return None
        assert self.client is not None
        try:
            async with asyncio.timeout(self.timeout_s):
                data = await self.client.get(key)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("get", exc)
            CACHE_LOOKUPS.labels(self.service, "response", "error").inc()
            return None
        if data is None:
            self.stats.misses += 1
            CACHE_LOOKUPS.labels(self.service, "response", "miss").inc()
            return None
        try:
            resp = decode_response(data if isinstance(data, bytes) else data.encode())
        except CorruptEntry as exc:
            self.stats.corrupt += 1
            CACHE_LOOKUPS.labels(self.service, "response", "corrupt").inc()
            log.warning("cache_corrupt_entry", key=key, error=str(exc))
            return None
        self.stats.hits += 1
        CACHE_LOOKUPS.labels(self.service, "response", "hit").inc()
        return resp

    async def put(self, key: str, resp: CachedResponse) -> bool:
        """Store ``resp`` under ``key`` with the TTL; False when skipped (too large, Redis down)."""
        if not self._available():
            return False
        assert self.client is not None
        data = encode_response(resp)
        if len(data) > self.max_entry_bytes:
            self.stats.too_large += 1
            CACHE_STORES.labels(self.service, "response", "too_large").inc()
            return False
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.client.set(key, data, ex=self.ttl_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("put", exc)
            CACHE_STORES.labels(self.service, "response", "error").inc()
            return False
        self.stats.stored += 1
        CACHE_STORES.labels(self.service, "response", "stored").inc()
        return True

    async def delete(self, key: str) -> bool:
        """Remove one entry; False when it did not exist or Redis is unavailable."""
        if not self._available():
            return False
        assert self.client is not None
        try:
            async with asyncio.timeout(self.timeout_s):
                return bool(await self.client.delete(key))
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("delete", exc)
            return False

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
