"""A Redis that accepts connections but never answers: every call ends at its timeout, a miss."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.store.guard import Guard
from services.store.keys import STATS_KEY
from services.store.kv_blocks import KVBlockStore, KVContext
from services.store.response_cache import CachedResponse, Finish, ResponseCache

pytestmark = pytest.mark.integration
KEY = "meshserve:v1:{r|m|0|0}:e:slow"
RESP = CachedResponse((1, 2), "ok", Finish.STOP, 3, 2)


@pytest.fixture
async def silent_url() -> AsyncIterator[str]:
    """A TCP server on 127.0.0.1:0 that reads requests and never replies (a hung Redis)."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def test_hung_redis_is_a_miss_at_the_timeout_then_skipped(silent_url: str) -> None:
    cache = ResponseCache.from_url(silent_url, timeout_s=0.05, retry_after_s=30)
    try:
        t0 = time.perf_counter()
        assert await cache.get(KEY) is None
        first = time.perf_counter() - t0
        assert first < 2.0  # bounded by the 50 ms timeout (generous for a loaded machine)
        assert cache.stats.errors == 1
        assert not await cache.put(KEY, RESP)  # the breaker is open: not even tried
        assert await cache.get(KEY) is None and cache.stats.skipped_while_down == 1
    finally:
        await cache.close()


async def test_hung_redis_fails_concurrent_kv_calls_open(silent_url: str) -> None:
    from services.store.connection import redis_from_url

    guard = Guard(redis_from_url(silent_url, 0.05), timeout_s=0.05)
    guard.breaker.failure_threshold = 100  # every call reaches the silent server
    store = KVBlockStore(guard, block_tokens=2, timeout_s=0.1)
    ctx = KVContext("m", "v", "t")
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(store.match(ctx, [1, 2, 3, 4]) for _ in range(8)), store.load(ctx, [1, 2])), 10
        )
        assert results == [0] * 8 + [[]]
        assert guard.breaker.failures == 9 and guard.tally["kv:lookup:error"] == 9
    finally:
        await guard.close()


async def test_counts_reach_the_shared_stats_hash_in_the_background(redis_url: str) -> None:
    cache = ResponseCache.from_url(redis_url, timeout_s=1.0)
    cache.guard.stats_flush_s = 0.05
    raw = aioredis.Redis.from_url(redis_url)
    try:
        before = int(await raw.hget(STATS_KEY, "response:lookup:miss") or 0)
        assert await cache.get(KEY + "-absent") is None  # counted; the flush is only scheduled
        for _ in range(200):  # bounded wait for the background flush (no request triggers it)
            if int(await raw.hget(STATS_KEY, "response:lookup:miss") or 0) > before:
                break
            await asyncio.sleep(0.01)
        assert int(await raw.hget(STATS_KEY, "response:lookup:miss") or 0) == before + 1
    finally:
        await raw.aclose()
        await cache.close()
