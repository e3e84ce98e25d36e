"""KVBlockStore.leading_blocks against a real redis-server: how many leading blocks Redis holds."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

from services.store.connection import redis_from_url
from services.store.guard import Guard
from services.store.kv_blocks import KVBlockStore, KVContext
from tests.helpers import RedisServer, free_port

pytestmark = pytest.mark.integration

BT = 4
SHAPE = (2, 2, 1, BT, 8)
A = KVContext("m", "v1", "tenant-a")
PROMPT = list(range(100, 122))  # 5 full blocks + 2 tokens


def blocks(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(n)]


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[KVBlockStore]:
    guard = Guard(redis_from_url(redis_url, 1.0), timeout_s=1.0, service="test")
    yield KVBlockStore(guard, block_tokens=BT, ttl_s=60, timeout_s=1.0)
    await guard.close()


async def test_nothing_stored_is_zero_and_counts_no_lookup(store: KVBlockStore) -> None:
    assert await store.leading_blocks(A, PROMPT) == 0
    assert await store.leading_blocks(A, PROMPT[:3]) == 0  # no full block: nothing to hold
    assert not store.guard.tally  # an operator's question is not a cache lookup


async def test_leading_run_and_gap(store: KVBlockStore, redis_url: str) -> None:
    assert await store.put(A, PROMPT, blocks(3)) == 3
    assert await store.leading_blocks(A, PROMPT) == 3
    assert await store.leading_blocks(A, PROMPT, limit=2) == 2  # the cap bounds the keys looked at
    assert await store.leading_blocks(A, PROMPT[:8]) == 2  # a shorter prompt: its own blocks only
    # Block 4 present but block 3 missing: the run stops at the gap.
    assert await store.put(A, PROMPT, blocks(1), first_block=4) == 1
    assert await store.leading_blocks(A, PROMPT) == 3
    raw = aioredis.Redis.from_url(redis_url)
    try:
        assert await raw.unlink(store.keys(A, PROMPT)[1]) == 1
    finally:
        await raw.aclose()
    assert await store.leading_blocks(A, PROMPT) == 1
    # A prompt that diverges inside block 1 shares only block 0.
    assert await store.leading_blocks(A, [*PROMPT[:5], 7, *PROMPT[6:]]) == 1


async def test_other_tenant_and_shared_scope_are_not_counted(store: KVBlockStore) -> None:
    assert await store.put(A, PROMPT, blocks(5)) == 5
    assert await store.leading_blocks(KVContext("m", "v1", "tenant-b"), PROMPT) == 0
    assert await store.leading_blocks(KVContext("m", "v1", "tenant-a", shareable=True), PROMPT) == 0
    assert await store.leading_blocks(KVContext("m", "v2", "tenant-a"), PROMPT) == 0
    shared = KVContext("m", "v1", "anyone", shareable=True)
    assert await store.put(shared, PROMPT, blocks(2)) == 2
    assert await store.leading_blocks(KVContext("m", "v1", "someone-else", shareable=True), PROMPT) == 2
    assert await store.leading_blocks(A, PROMPT) == 5


async def test_redis_down_is_unknown_then_recovers(tmp_path: object) -> None:
    server = RedisServer(port=free_port(), dir=str(tmp_path))
    server.start()
    guard = Guard(redis_from_url(server.url, 0.2), timeout_s=0.2)
    guard.breaker.reset_s = 0.0
    store = KVBlockStore(guard, block_tokens=BT, timeout_s=0.2)
    try:
        assert await store.put(A, PROMPT, blocks(2)) == 2
        server.stop()
        assert await store.leading_blocks(A, PROMPT) is None
        assert await store.leading_blocks(A, PROMPT) is None  # breaker open or failing: still no raise
        server.start()  # a fresh, empty Redis on the same port
        for _ in range(5):  # half-open probes until a call succeeds (bounded)
            if await store.leading_blocks(A, PROMPT) is not None:
                break
        assert await store.leading_blocks(A, PROMPT) == 0
    finally:
        await guard.close()
        server.stop()


async def test_no_redis_configured_is_unknown() -> None:
    store = KVBlockStore(Guard(None), block_tokens=BT)
    assert await store.leading_blocks(A, PROMPT) is None
