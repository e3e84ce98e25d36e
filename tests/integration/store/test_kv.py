"""KVBlockStore against a real redis-server: round trips, partial prefixes, tenants, corruption, budgets."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from services.store.connection import redis_from_url
from services.store.guard import Guard
from services.store.keys import scope_of
from services.store.kv_blocks import KVBlockStore, KVContext
from services.store.kv_codec import encode_block
from tests.helpers import RedisServer, free_port

pytestmark = pytest.mark.integration

BT = 4  # tokens per block
SHAPE = (2, 2, 1, BT, 8)  # [layers, k/v, kv_heads, block_tokens, head_dim]
A = KVContext("m", "v1", "tenant-a")
B = KVContext("m", "v1", "tenant-b")
PROMPT = list(range(100, 118))  # 4 full blocks + 2 tokens


def blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(n)]


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[KVBlockStore]:
    guard = Guard(redis_from_url(redis_url, 1.0), timeout_s=1.0, service="test")
    yield KVBlockStore(guard, block_tokens=BT, ttl_s=60, budget_bytes=1 << 20)
    await guard.close()


async def test_round_trip_numpy_and_torch(store: KVBlockStore) -> None:
    data = blocks(4)
    assert await store.put(A, PROMPT, data) == 4
    assert await store.match(A, PROMPT) == 4
    out = await store.load(A, PROMPT)
    assert len(out) == 4 and all(np.array_equal(x, y) for x, y in zip(out, data, strict=True))
    t = [torch.randn(SHAPE, dtype=torch.bfloat16) for _ in range(2)]
    other = list(range(8))
    assert await store.put(A, other, t) == 2
    back = await store.load(A, other, as_="torch")
    assert all(x.dtype == torch.bfloat16 and torch.equal(x, y) for x, y in zip(back, t, strict=True))


async def test_partial_prefix_match(store: KVBlockStore) -> None:
    data = blocks(4)
    assert await store.put(A, PROMPT, data[:2]) == 2
    assert await store.match(A, PROMPT) == 2
    assert len(await store.load(A, PROMPT)) == 2
    # a prompt sharing the first 1.5 blocks only matches the first block
    diverging = [*PROMPT[:6], 999, 998, *PROMPT[8:]]
    assert await store.match(A, diverging) == 1
    got = await store.load(A, diverging)
    assert len(got) == 1 and np.array_equal(got[0], data[0])
    # the rest of the chain is added later without resending the head
    assert await store.put(A, PROMPT, data[2:], first_block=2) == 2
    assert await store.match(A, PROMPT) == 4
    assert await store.match(A, PROMPT[:3]) == 0  # shorter than a block


async def test_tenants_never_read_each_others_blocks(store: KVBlockStore) -> None:
    a, b = blocks(3, seed=1), blocks(3, seed=2)
    assert await store.put(A, PROMPT, a) == 3
    assert await store.match(B, PROMPT) == 0 and await store.load(B, PROMPT) == []
    assert await store.put(B, PROMPT, b) == 3
    assert np.array_equal((await store.load(A, PROMPT))[0], a[0])  # B's write did not replace A's
    assert np.array_equal((await store.load(B, PROMPT))[0], b[0])
    sa, sb = KVContext("m", "v1", "tenant-a", shareable=True), KVContext("m", "v1", "tenant-b", shareable=True)
    assert await store.match(sa, PROMPT) == 0  # private blocks are not shared
    assert await store.put(sb, PROMPT, b[:2]) == 2
    assert await store.match(sa, PROMPT) == 2  # shared prefix: readable by every tenant
    assert await store.match(KVContext("m", "v2", "tenant-a", shareable=True), PROMPT) == 0  # other version


async def test_corrupt_and_old_format_blocks_end_the_chain(store: KVBlockStore, redis_url: str) -> None:
    data = blocks(4)
    assert await store.put(A, PROMPT, data) == 4
    keys = store.keys(A, PROMPT)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        good = encode_block(data[2])
        await raw.set(keys[2], good[:4] + bytes([0]) + good[5:])  # old format version
        out = await store.load(A, PROMPT)
        assert len(out) == 2 and store.guard.tally["kv:lookup:corrupt"] == 2
        await raw.set(keys[1], b"\x80\x04\x95pickle")
        assert len(await store.load(A, PROMPT)) == 1
        await raw.set(keys[0], good[:6] + bytes([9]) + good[7:])  # impossible rank
        assert await store.load(A, PROMPT) == []
    finally:
        await raw.aclose()


async def test_byte_budgets_hold(redis_url: str) -> None:
    one = len(encode_block(blocks(1)[0]))
    guard = Guard(redis_from_url(redis_url, 1.0), timeout_s=1.0)
    store = KVBlockStore(guard, block_tokens=BT, ttl_s=60, budget_bytes=one * 3, max_block_bytes=one)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        # per entry: a bigger block ends the store before it
        big = np.zeros((2, 2, 2, BT, 8), dtype=np.float16)
        assert await store.put(A, PROMPT, [blocks(1)[0], big, blocks(1)[0]]) == 1
        # per scope: 4 blocks into a 3-block budget -> 3 stored, never more bytes than the budget
        assert await store.put(A, PROMPT, blocks(4)) == 3
        for i in range(6):
            prompt = [i * 1000 + t for t in range(2 * BT)]
            assert await store.put(A, prompt, blocks(2, seed=i)) == 2
            ix, _sz, used = scope_of(store.keys(A, prompt)[0])
            members = await raw.zrange(ix, 0, -1)
            total = sum(len(v) for v in await raw.mget(members) if v is not None)
            assert total <= one * 3 and int(await raw.get(used)) <= one * 3
        assert await store.match(A, prompt) == 2  # the newest chain survived eviction
        assert guard.tally["kv:store:too_large"] == 1 and guard.tally["kv:store:over_budget"] == 1
    finally:
        await raw.aclose()
        await guard.close()


async def test_redis_down_is_an_empty_match_then_recovers(tmp_path: object) -> None:
    server = RedisServer(port=free_port(), dir=str(tmp_path))
    server.start()
    guard = Guard(redis_from_url(server.url, 0.2), timeout_s=0.2)
    guard.breaker.reset_s = 0.0
    store = KVBlockStore(guard, block_tokens=BT, timeout_s=0.2)
    try:
        assert await store.put(A, PROMPT, blocks(4)) == 4
        server.stop()
        assert await store.match(A, PROMPT) == 0
        assert await store.load(A, PROMPT) == []
        assert await store.put(A, PROMPT, blocks(4)) == 0
        server.start()
        for _ in range(5):  # half-open probes until a call succeeds (bounded)
            if await store.put(A, PROMPT, blocks(4)) == 4:
                break
        assert await store.match(A, PROMPT) == 4
    finally:
        await guard.close()
        server.stop()
