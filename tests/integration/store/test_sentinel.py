"""redis+sentinel:// URLs against a real Sentinel (redis-server --sentinel) monitoring a real master."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis

from services.store.connection import redis_from_url
from services.store.guard import Guard
from services.store.kv_blocks import KVBlockStore, KVContext
from services.store.response_cache import CachedResponse, Finish, ResponseCache
from tests.helpers import SENTINEL_MASTER, RedisServer, free_port, wait_for_sentinel_master

pytestmark = pytest.mark.integration
MASTER = SENTINEL_MASTER
KEY = "meshserve:v1:{r|m|0|0}:e:sentinel"
RESP = CachedResponse((1, 2, 3), "via sentinel", Finish.STOP, 4, 3)


@dataclass
class SentinelSetup:
    master: RedisServer
    sentinel_port: int
    replica_port: int

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{MASTER}"


def _wait_for_replica(port: int, replica_port: int, timeout_s: float = 30.0) -> None:
    """Poll Sentinel until it knows the replica as a healthy, linked replica (else no failover)."""
    client = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=0.5, decode_responses=True)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            replicas = client.sentinel_slaves(MASTER)
            if any(
                int(r.get("port", 0)) == replica_port
                and r.get("flags") == "slave"
                and r.get("master-link-status") == "ok"
                for r in replicas
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"sentinel never saw replica {replica_port} in sync: {replicas}")
            time.sleep(0.05)
    finally:
        client.close()


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelSetup]:
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is not installed; run `make setup`"
    (tmp_path / "master").mkdir()
    master = RedisServer(port=free_port(), dir=str(tmp_path / "master"))
    master.start()
    setup = redis.Redis(port=master.port)
    setup.config_set("repl-diskless-sync-delay", 0)  # else the replica's first sync waits 5 s for company
    setup.close()
    replica_port = free_port()
    argv = [exe, "--port", str(replica_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    replica = subprocess.Popen(
        [*argv, "--dir", str(tmp_path), "--replicaof", "127.0.0.1", str(master.port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port = free_port()
    conf = tmp_path / "sentinel.conf"  # Sentinel rewrites its config file: it must be writable
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor {MASTER} 127.0.0.1 {master.port} 1\n"
        f"sentinel down-after-milliseconds {MASTER} 500\nsentinel failover-timeout {MASTER} 2000\n"
    )
    proc = subprocess.Popen([exe, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_sentinel_master(port, ("127.0.0.1", master.port))
        yield SentinelSetup(master, port, replica_port)
    finally:
        for p in (proc, replica):
            p.terminate()
            p.wait(timeout=10)
        master.stop()


async def test_response_round_trip_through_sentinel(sentinel: SentinelSetup) -> None:
    cache = ResponseCache.from_url(sentinel.url, timeout_s=1.0)
    try:
        assert await cache.put(KEY, RESP)
        assert await cache.get(KEY) == RESP
        direct = redis.Redis(port=sentinel.master.port)  # it really went to the master Sentinel named
        try:
            assert direct.exists(KEY) == 1
        finally:
            direct.close()
        assert cache.stats.errors == 0
    finally:
        await cache.close()


async def test_kv_round_trip_through_sentinel(sentinel: SentinelSetup) -> None:
    guard = Guard(redis_from_url(sentinel.url, 1.0), timeout_s=1.0)
    store = KVBlockStore(guard, block_tokens=4)
    ctx = KVContext("m", "v", "tenant")
    blocks = [np.full((2, 4, 8), i, dtype=np.float16) for i in range(3)]
    prompt = list(range(14))  # three full blocks and a partial one
    try:
        assert await store.put(ctx, prompt, blocks) == 3
        assert await store.match(ctx, prompt) == 3
        loaded = await store.load(ctx, prompt)
        assert len(loaded) == 3 and all(np.array_equal(a, b) for a, b in zip(loaded, blocks, strict=True))
        assert await store.match(KVContext("m", "v", "other"), prompt) == 0  # tenants stay apart
    finally:
        await guard.close()


async def test_master_crash_fails_over_and_the_cache_follows(sentinel: SentinelSetup) -> None:
    cache = ResponseCache.from_url(sentinel.url, timeout_s=1.0, retry_after_s=0)
    old_master = redis.Redis(port=sentinel.master.port, socket_timeout=5)
    new_master = redis.Redis(port=sentinel.replica_port, socket_timeout=2)
    try:
        await asyncio.to_thread(_wait_for_replica, sentinel.sentinel_port, sentinel.replica_port)
        assert await cache.put(KEY, RESP)
        assert old_master.execute_command("WAIT", 1, 5000) == 1  # the replica has it
        old_master.close()
        sentinel.master.stop()  # the master dies; Sentinel promotes the replica
        promoted = ("127.0.0.1", sentinel.replica_port)
        await asyncio.to_thread(wait_for_sentinel_master, sentinel.sentinel_port, promoted, 30)
        # A call on the dead master's pooled connection may fail (a miss, never an exception); the
        # client then asks Sentinel again and lands on the promoted replica. Bounded in time.
        after = KEY + "-after"
        deadline = time.monotonic() + 15
        while not await cache.put(after, RESP):
            assert time.monotonic() < deadline, f"no write reached the new master: {cache.stats}"
            await asyncio.sleep(0.05)  # polling the client's switch to the new master (no event)
        assert new_master.exists(after) == 1
        assert await cache.get(after) == RESP
        assert await cache.get(KEY) == RESP  # written before the crash, replicated: still a hit
    finally:
        old_master.close()
        new_master.close()
        await cache.close()
