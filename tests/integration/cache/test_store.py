"""ResponseCache against a real redis-server: TTL, size limit, corrupt values, outage."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from services.cache.keys import SamplingSpec, response_key
from services.cache.store import CachedResponse, Finish, ResponseCache
from tests.helpers import RedisServer, free_port

pytestmark = pytest.mark.integration

RESP = CachedResponse((5, 6, 7), " a b c", Finish.STOP, prompt_tokens=4, completion_tokens=3)
KEY = response_key(
    model_id="m",
    model_version="v",
    tokenizer_id="t",
    sampling=SamplingSpec(max_tokens=3),
    prompt_ids=[1, 2, 3, 4],
    tenant="acme",
)


async def test_put_get_ttl(redis_url: str) -> None:
    cache = ResponseCache.from_url(redis_url, ttl_s=60, service="test")
    try:
        assert await cache.get(KEY) is None
        assert await cache.put(KEY, RESP)
        assert await cache.get(KEY) == RESP
        assert cache.client is not None
        assert 0 < await cache.client.ttl(KEY) <= 60
        assert (cache.stats.hits, cache.stats.misses, cache.stats.stored) == (1, 1, 1)
        assert await cache.delete(KEY)
        assert await cache.get(KEY) is None
    finally:
        await cache.close()


async def test_too_large_is_not_stored(redis_url: str) -> None:
    cache = ResponseCache.from_url(redis_url, max_entry_bytes=64)
    try:
        big = CachedResponse(tuple(range(100)), "x" * 100, Finish.LENGTH, 1, 100)
        assert not await cache.put(KEY, big)
        assert cache.stats.too_large == 1 and await cache.get(KEY) is None
    finally:
        await cache.close()


async def test_corrupt_and_foreign_values_are_ignored(redis_url: str) -> None:
    cache = ResponseCache.from_url(redis_url)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await raw.set(KEY, b"\x80\x04\x95pickled-garbage")
        assert await cache.get(KEY) is None
        assert cache.stats.corrupt == 1
    finally:
        await raw.aclose()
        await cache.close()


async def test_unreachable_redis_is_a_fast_miss() -> None:
    cache = ResponseCache.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.05, retry_after_s=30)
    try:
        t0 = time.perf_counter()
        assert await cache.get(KEY) is None
        assert not await cache.put(KEY, RESP)
        for _ in range(100):  # skipped while down: no connection attempts
            assert await cache.get(KEY) is None
        assert time.perf_counter() - t0 < 1.0
        assert cache.stats.errors == 1 and cache.stats.skipped_while_down >= 100
    finally:
        await cache.close()


async def test_recovers_after_outage(redis_srv: RedisServer, redis_url: str) -> None:
    cache = ResponseCache.from_url(redis_url, retry_after_s=0)
    try:
        redis_srv.stop()
        try:
            assert not await cache.put(KEY, RESP)
            assert await cache.get(KEY) is None
        finally:
            redis_srv.start()
        assert await cache.put(KEY, RESP)
        assert await cache.get(KEY) == RESP
    finally:
        await cache.close()


async def test_disabled_when_url_empty() -> None:
    cache = ResponseCache.from_url("")
    assert not cache.enabled and await cache.get(KEY) is None
