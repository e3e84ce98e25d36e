"""Redis URLs: single server, Sentinel and Cluster schemes, with readable errors."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from services.store.connection import redis_from_url


async def test_single_server() -> None:
    client = redis_from_url("redis://127.0.0.1:6390/2", 0.05)
    assert isinstance(client, Redis)
    assert client.connection_pool.connection_kwargs["db"] == 2
    assert client.connection_pool.connection_kwargs["socket_connect_timeout"] == 0.05
    await client.aclose()


async def test_cluster_url_lists_startup_nodes() -> None:
    client = redis_from_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001", 0.05)
    assert isinstance(client, RedisCluster)
    assert {(n.host, n.port) for n in client.nodes_manager.startup_nodes.values()} == {
        ("10.0.0.1", 7000),
        ("10.0.0.2", 7001),
    }
    await client.aclose()


async def test_sentinel_url_names_master_and_db() -> None:
    client = redis_from_url("redis+sentinel://s1:26379,s2/mymaster/3", 0.05)
    pool = client.connection_pool
    assert pool.service_name == "mymaster"  # type: ignore[attr-defined]
    assert pool.connection_kwargs["db"] == 3
    assert [
        (c.connection_pool.connection_kwargs["host"], c.connection_pool.connection_kwargs["port"])
        for c in pool.sentinel_manager.sentinels
    ] == [("s1", 26379), ("s2", 26379)]  # type: ignore[attr-defined]
    await client.aclose()


@pytest.mark.parametrize(
    "url",
    ["http://x:1", "redis+sentinel://s1:26379", "redis+cluster://h:notaport", "redis+cluster://"],
)
def test_bad_urls_say_how_to_fix(url: str) -> None:
    with pytest.raises(ValueError, match=r"Redis URL|Sentinel|host:port"):
        redis_from_url(url, 0.05)
