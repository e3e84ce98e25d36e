"""services/cache on a real Redis Cluster (one node owning all 16384 slots).

A cluster node refuses any multi-key command whose keys hash to different slots (CROSSSLOT), even
when it owns them all, so these tests prove that every multi-key operation of the caches (the
ledger script of a put, MGET of a KV chain, the prefix-length script) stays within one slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import ResponseError

from services.common.sampling import SamplingParams
from services.store.connection import redis_from_url
from services.store.guard import Guard
from services.store.keys import response_key, scope_of
from services.store.kv_blocks import KVBlockStore, KVContext
from services.store.response_cache import ResponseCache
from services.store.response_codec import CachedResponse, Finish
from tests.helpers import redis_cluster_node

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with redis_cluster_node(str(tmp_path_factory.mktemp("cluster"))) as port:
        yield port


@pytest.fixture
async def guard(cluster_port: int) -> AsyncIterator[Guard]:
    g = Guard(redis_from_url(f"redis+cluster://127.0.0.1:{cluster_port}", 2.0), timeout_s=2.0)
    yield g
    await g.close()


async def test_cluster_refuses_cross_slot_commands(cluster_port: int) -> None:
    client = redis.Redis(port=cluster_port)
    try:
        assert key_slot(b"a") != key_slot(b"b")
        with pytest.raises(ResponseError, match=r"CROSSSLOT|same slot"):
            client.execute_command("MGET", "a", "b")
    finally:
        client.close()


async def test_response_put_and_get_on_cluster(guard: Guard) -> None:
    cache = ResponseCache(guard, ttl_s=60)
    key = response_key(
        model_id="m",
        model_version="v",
        tier="edge",
        tokenizer_id="t",
        sampling=SamplingParams(max_tokens=2),
        prompt_ids=[1, 2],
        tenant="acme",
    )
    assert len({key_slot(k.encode()) for k in (key, *scope_of(key))}) == 1
    resp = CachedResponse((7, 8), "hi", Finish.STOP, 2, 2)
    assert await cache.put(key, resp)
    assert await cache.get(key) == resp
    assert cache.stats.errors == 0


async def test_kv_chain_operations_on_cluster(guard: Guard) -> None:
    store = KVBlockStore(guard, block_tokens=4, ttl_s=60, budget_bytes=1024)
    ctx = KVContext("m", "v", "acme")
    prompt = list(range(32))
    keys = store.keys(ctx, prompt)
    assert len({key_slot(k.encode()) for k in (*keys, *scope_of(keys[0]))}) == 1
    data = [np.full((2, 2, 1, 4, 8), i, dtype=np.float16) for i in range(8)]
    assert await store.put(ctx, prompt, data) == 3  # the 1 KiB budget holds 3 blocks
    assert await store.match(ctx, prompt) == 3 and await store.leading_blocks(ctx, prompt) == 3
    assert len(await store.load(ctx, prompt)) == 3
    other = list(range(100, 112))
    assert await store.put(ctx, other, data[:3]) == 3  # evicts the first chain inside the script
    assert await store.match(ctx, prompt) == 0 and await store.match(ctx, other) == 3
    assert guard.breaker.failures == 0 and guard.tally["kv:lookup:error"] == 0
