"""ResponseCache against a real redis-server: TTL, size limit, tenant isolation, corrupt values, budgets, outage."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from services.common.sampling import SamplingParams
from services.store.keys import response_key, scope_of
from services.store.response_cache import CachedResponse, Finish, ResponseCache
from services.store.response_codec import encode_response
from tests.helpers import RedisServer, free_port

pytestmark = pytest.mark.integration

RESP = CachedResponse((5, 6, 7), " a b c", Finish.STOP, prompt_tokens=4, completion_tokens=3)
KEY = response_key(
    model_id="m",
    model_version="v",
    tier="edge",
    tokenizer_id="t",
    sampling=SamplingParams(max_tokens=3),
    prompt_ids=[1, 2, 3, 4],
    tenant="acme",
)


async def test_put_get_ttl(redis_url: str) -> None:
    cache = ResponseCache.from_url(redis_url, ttl_s=60, timeout_s=1.0, service="test")  # 50 ms: flaky at load 10
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


def _key(tenant: str, shareable: bool = False) -> str:
    return response_key(
        model_id="m",
        model_version="v",
        tier="edge",
        tokenizer_id="t",
        sampling=SamplingParams(max_tokens=3),
        prompt_ids=[1, 2, 3, 4],
        tenant=tenant,
        shareable=shareable,
    )


async def test_tenants_never_read_each_others_responses(redis_url: str) -> None:
    cache = ResponseCache.from_url(redis_url, timeout_s=1)
    try:
        a = CachedResponse((1,), "secret of a", Finish.STOP, 4, 1)
        b = CachedResponse((2,), "secret of b", Finish.STOP, 4, 1)
        assert await cache.get(_key("b")) is None
        assert await cache.put(_key("a"), a)
        assert await cache.get(_key("b")) is None  # A wrote, B cannot read
        assert await cache.put(_key("b"), b)
        assert await cache.get(_key("a")) == a and await cache.get(_key("b")) == b  # B wrote, A still sees its own
        assert await cache.get(_key("a", shareable=True)) is None  # private entries are not shared
        shared = CachedResponse((3,), "public", Finish.STOP, 4, 1)
        assert await cache.put(_key("a", shareable=True), shared)
        assert await cache.get(_key("b", shareable=True)) == shared  # shared prefix: both ways
        assert await cache.get(_key("b")) == b
    finally:
        await cache.close()


async def test_old_format_values_are_ignored_and_counted(redis_url: str) -> None:
    cache = ResponseCache.from_url(redis_url, timeout_s=1)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        good = encode_response(RESP)
        await raw.set(KEY, good[:4] + bytes([0]) + good[5:])  # format version 0
        assert await cache.get(KEY) is None
        await raw.set(KEY, good[:4] + bytes([2]) + good[5:])  # a newer writer's format
        assert await cache.get(KEY) is None
        await raw.set(KEY, good[:-1])  # truncated
        assert await cache.get(KEY) is None
        assert cache.stats.corrupt == 3 and cache.stats.hits == 0
        assert cache.guard.tally["response:lookup:corrupt"] == 3
    finally:
        await raw.aclose()
        await cache.close()


async def test_byte_budget_holds_and_evicts_oldest(redis_url: str) -> None:
    entry = CachedResponse(tuple(range(40)), "x" * 100, Finish.LENGTH, 4, 40)
    size = len(encode_response(entry))
    budget = size * 5 + size // 2
    cache = ResponseCache.from_url(redis_url, timeout_s=1, budget_bytes=budget)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        keys = [
            response_key(
                model_id="m",
                model_version="v",
                tier="edge",
                tokenizer_id="t",
                sampling=SamplingParams(max_tokens=40),
                prompt_ids=[i],
                tenant="acme",
            )
            for i in range(20)
        ]
        for k in keys:
            assert await cache.put(k, entry)
            stored = [x for x in await raw.mget(keys) if x is not None]
            assert sum(len(x) for x in stored) <= budget
        assert await cache.get(keys[-1]) == entry  # newest kept
        assert await cache.get(keys[0]) is None  # oldest evicted
        _ix, _sz, used = scope_of(keys[0])
        assert int(await raw.get(used)) == size * 5
        assert 0 < await raw.ttl(used)
        other_tenant = response_key(
            model_id="m",
            model_version="v",
            tier="edge",
            tokenizer_id="t",
            sampling=SamplingParams(max_tokens=40),
            prompt_ids=[0],
            tenant="other",
        )
        assert await cache.put(other_tenant, entry)  # budgets are per tenant: one cannot evict another
        assert await cache.get(keys[-1]) == entry
    finally:
        await raw.aclose()
        await cache.close()
