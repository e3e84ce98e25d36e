"""The shared rollout store (services/store/rollouts.py) on a real redis-server and a real one-node
Redis Cluster: epoch-ordered writes, their pub/sub notice, malformed entries skipped, and every
failure as Unavailable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from services.common.errors import Unavailable
from services.store.keys import rollout_key
from services.store.rollouts import Notices, RolloutStore
from tests.helpers import free_port, redis_cluster_node

pytestmark = pytest.mark.integration
POLICY = {"weights": [["v1", 95], ["v2", 5]], "sticky": "chat", "shadow": None, "primary": "v1"}


@pytest.fixture(scope="module")
def cluster_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with redis_cluster_node(str(tmp_path_factory.mktemp("cluster"))) as port:
        yield port


@pytest.fixture(params=["single", "cluster"])
async def store(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[RolloutStore]:
    url = (
        redis_url
        if request.param == "single"
        else f"redis+cluster://127.0.0.1:{request.getfixturevalue('cluster_port')}"
    )
    opened = RolloutStore.from_url(url, timeout_s=2.0)
    if request.param == "cluster":  # the cluster node is the module's: start each test clean
        for model in ("m", "other", "bad"):
            await opened._client.delete(rollout_key(model))
    yield opened
    await opened.close()


async def test_writes_are_numbered_in_order_above_the_floor_and_read_back(store: RolloutStore) -> None:
    assert await store.read(["m"]) == {}
    assert await store.write("m", POLICY, by="r1", reason="set") == 1
    assert await store.write("m", {**POLICY, "shadow": "v2"}, by="r2", reason="manual") == 2
    assert await store.write("m", POLICY, by="r3", reason="set", floor=9) == 10  # a writer that held epoch 9
    assert await store.write("m", POLICY, by="r3", reason="set", floor=3) == 11  # never back
    got = await store.read(["m", "other"])
    assert list(got) == ["m"]
    assert (got["m"].epoch, got["m"].by, got["m"].reason, got["m"].policy) == (11, "r3", "set", POLICY)


async def test_a_write_is_announced_to_a_subscriber(store: RolloutStore) -> None:
    notices = store.notices(poll_s=0.2)
    try:
        assert await notices.next() is None  # subscribes; nothing announced yet
        waiter = asyncio.create_task(_next_model(notices))
        await asyncio.sleep(0.05)
        await store.write("other", POLICY, by="r1", reason="set")
        assert await asyncio.wait_for(waiter, 5) == "other"
    finally:
        await notices.close()


async def _next_model(notices: Notices) -> str:
    while (model := await notices.next()) is None:
        pass
    return model


async def test_a_malformed_entry_is_skipped(store: RolloutStore) -> None:
    await store._client.hset(rollout_key("bad"), mapping={"epoch": "x", "policy": "{"})
    await store.write("m", POLICY, by="r1", reason="set")
    assert list(await store.read(["bad", "m"])) == ["m"]


async def test_an_unreachable_redis_is_unavailable() -> None:
    store = RolloutStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.3)
    try:
        with pytest.raises(Unavailable, match="rollout store"):
            await store.read(["m"])
        with pytest.raises(Unavailable, match="rollout store"):
            await store.write("m", POLICY, by="r1", reason="set")
        with pytest.raises(Unavailable, match="rollout store"):
            await store.notices(0.1).next()
    finally:
        await store.close()


async def test_many_models_are_read_in_one_round_trip(store: RolloutStore) -> None:
    """More models than the store's connection pool holds (8): one pipelined read, not one call each."""
    names = [f"many-{i}" for i in range(20)]
    for name in names[::2]:
        await store.write(name, POLICY, by="r1", reason="set")
    got = await store.read(names)
    assert list(got) == names[::2] and all(p.epoch == 1 for p in got.values())
    for name in names[::2]:  # the cluster node outlives the test
        await store._client.delete(rollout_key(name))
