"""The two Redis of `meshserve up`, as real redis-servers started by the launcher's own code
(:meth:`Mesh.start_redis`): the state Redis keeps an append-only file and never evicts; the cache Redis
evicts and keeps nothing. Durable state (API keys, files, batches, stored responses) written through
a real gateway configured as the mesh configures it lands in the state Redis only, so flushing the
cache Redis, or filling it past its maxmemory, loses none of it; a kill -9 of the state Redis loses
nothing either, nor does a restart of the mesh on the same state directory."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError

from services.common.pb.meshserve.v1 import batch_pb2 as bpb
from services.common.pb.meshserve.v1 import batch_pb2_grpc
from services.gateway.config import GatewaySettings
from services.gateway.keystore import KeyStore
from services.gateway.server import start_gateway
from services.local.mesh import STATE_REDIS, Mesh, MeshConfig
from services.local.redis_server import wait_redis
from services.store.responses import ResponseStore

pytestmark = pytest.mark.integration
TENANT = "acme"
LINES = 5


async def _config(client: aioredis.Redis, name: str) -> str:
    value = (await client.config_get(name))[name]
    return value.decode() if isinstance(value, bytes) else str(value)


@pytest.fixture
async def mesh_redis(tmp_path: Path) -> AsyncIterator[Mesh]:
    """The cache and the state Redis exactly as `meshserve up` starts them (a small cache: evictions)."""
    mesh = Mesh(MeshConfig(state_dir=str(tmp_path / "state"), redis_maxmemory="4mb"), sink=lambda _n, _l: None)
    try:
        await mesh.start_redis()
        yield mesh
    finally:
        await mesh.stop()


async def test_the_state_redis_keeps_an_append_only_file_and_never_evicts(mesh_redis: Mesh, tmp_path: Path) -> None:
    state = aioredis.Redis.from_url(mesh_redis.state_redis_url, decode_responses=True)
    cache = aioredis.Redis.from_url(mesh_redis.redis_url, decode_responses=True)
    try:
        assert mesh_redis.state_redis_url != mesh_redis.redis_url
        assert await _config(state, "appendonly") == "yes"
        assert await _config(state, "appendfsync") == "always"
        assert await _config(state, "maxmemory-policy") == "noeviction"
        assert await _config(state, "save") == ""
        assert await _config(state, "dir") == str(tmp_path / "state")
        assert await _config(cache, "appendonly") == "no"
        assert await _config(cache, "maxmemory-policy") == "allkeys-lru"
        assert int(await _config(cache, "maxmemory")) == 4 * 1024 * 1024
        assert set(mesh_redis.redis_processes) == {"redis", STATE_REDIS}
    finally:
        await state.aclose()
        await cache.aclose()


@asynccontextmanager
async def _gateway(mesh: Mesh) -> AsyncIterator[batch_pb2_grpc.BatchesStub]:
    settings = GatewaySettings(  # what the mesh gives its gateways (tests/unit/deploy/test_topology.py)
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        router_address="127.0.0.1:1",  # files and batches need no router
        redis_url=mesh.redis_url,
        state_redis_url=mesh.state_redis_url,
        key_cache_ttl_s=0,  # every call reads its key from Redis
        shutdown_grace_s=0.5,
    )
    server, _gate = await start_gateway(settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield batch_pb2_grpc.BatchesStub(channel)
    finally:
        await server.stop()


def _input() -> bytes:
    rows = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": f"p{i}"}}
        for i in range(LINES)
    ]
    return "\n".join(json.dumps(r) for r in rows).encode()


async def test_flushing_or_filling_the_cache_redis_leaves_keys_files_batches_and_responses(mesh_redis: Mesh) -> None:
    state = aioredis.Redis.from_url(mesh_redis.state_redis_url)
    cache = aioredis.Redis.from_url(mesh_redis.redis_url)
    responses = ResponseStore.from_url(mesh_redis.state_redis_url, ttl_s=3600, timeout_s=1.0)  # the adapters' Redis
    try:
        key, _record = await KeyStore(state).create(TENANT, name="ci")  # `meshserve keys create`
        meta = (("authorization", f"Bearer {key}"),)
        async with _gateway(mesh_redis) as stub:
            upload = await stub.CreateFile(
                bpb.CreateFileRequest(filename="in.jsonl", purpose="batch", content=_input()), metadata=meta
            )
            batch = await stub.CreateBatch(
                bpb.CreateBatchRequest(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"),
                metadata=meta,
            )
            assert await responses.put("0" * 16, "resp_1", {"response": {"id": "resp_1"}})
            # Nothing durable went to the cache Redis (rate-limit buckets may be there).
            in_cache = [k.decode() async for k in cache.scan_iter(count=1000)]
            assert all(":rl:" in k for k in in_cache), in_cache
            # Fill the cache past its maxmemory (it evicts), then flush it outright.
            blob = b"x" * 64 * 1024
            for i in range(200):
                await cache.set(f"filler:{i}", blob)
            assert (await cache.info("stats"))["evicted_keys"] > 0
            assert await cache.flushdb()
            # Everything durable is still there, reached through the same gateway and key.
            again = await stub.GetBatch(bpb.BatchRef(batch_id=batch.id), metadata=meta, timeout=10)
            assert (again.id, again.request_counts.total) == (batch.id, LINES)
            content = stub.GetFileContent(bpb.FileRef(file_id=upload.id), metadata=meta)
            assert b"".join([part.content async for part in content]) == _input()
            assert await responses.get("0" * 16, "resp_1") == {"response": {"id": "resp_1"}}
            # Above a maxmemory the state Redis refuses a write instead of dropping a batch.
            used = int((await state.info("memory"))["used_memory"])
            await state.config_set("maxmemory", used + 64 * 1024)
            with pytest.raises(OutOfMemoryError):  # Redis' "OOM command not allowed"
                for i in range(64):
                    await state.set(f"big:{i}", blob)
            await state.config_set("maxmemory", 0)
            assert (await stub.GetBatch(bpb.BatchRef(batch_id=batch.id), metadata=meta)).id == batch.id
            assert (await state.info("stats"))["evicted_keys"] == 0
    finally:
        await responses.close()
        await state.aclose()
        await cache.aclose()


async def test_the_state_survives_a_kill_9_of_its_redis_and_a_restart_of_the_mesh(tmp_path: Path) -> None:
    directory = str(tmp_path / "state")
    mesh = Mesh(MeshConfig(state_dir=directory), sink=lambda _n, _l: None)
    try:
        await mesh.start_redis()
        client = aioredis.Redis.from_url(mesh.state_redis_url)
        key, _ = await KeyStore(client).create(TENANT, name="kept")
        await client.aclose()
        proc = mesh.redis_processes[STATE_REDIS]
        await proc.kill()  # SIGKILL, as `kill -9`; the supervisor then runs the same command again
        await proc.respawn()
        await wait_redis(mesh.state_redis_url, 30)
        client = aioredis.Redis.from_url(mesh.state_redis_url)
        assert await KeyStore(client).lookup(key) is not None
        await client.aclose()
    finally:
        await mesh.stop()
    # The next mesh on the same directory finds the key (`meshserve up` keeps the directory).
    again = Mesh(MeshConfig(state_dir=directory), sink=lambda _n, _l: None)
    try:
        await again.start_redis()
        client = aioredis.Redis.from_url(again.state_redis_url)
        assert await KeyStore(client).lookup(key) is not None
        await client.aclose()
    finally:
        await again.stop()


async def test_two_meshes_cannot_share_a_state_directory(tmp_path: Path) -> None:
    first = Mesh(MeshConfig(state_dir=str(tmp_path)), sink=lambda _n, _l: None)
    second = Mesh(MeshConfig(state_dir=str(tmp_path)), sink=lambda _n, _l: None)
    try:
        await first.start_redis()
        with pytest.raises(RuntimeError, match="in use by another mesh"):
            await second.start_redis()
    finally:
        await second.stop()
        await first.stop()


async def test_while_the_state_redis_is_down_batch_calls_are_unavailable_not_internal(mesh_redis: Mesh) -> None:
    state = aioredis.Redis.from_url(mesh_redis.state_redis_url)
    try:
        key, _record = await KeyStore(state).create(TENANT, name="ci")
    finally:
        await state.aclose()
    meta = (("authorization", f"Bearer {key}"),)
    proc = mesh_redis.redis_processes[STATE_REDIS]
    async with _gateway(mesh_redis) as stub:
        upload = await stub.CreateFile(
            bpb.CreateFileRequest(filename="in.jsonl", purpose="batch", content=_input()), metadata=meta
        )
        await proc.kill()
        ref = bpb.FileRef(file_id=upload.id)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetFile(ref, metadata=meta, timeout=10)
        # The key itself is in the state Redis: the key store's outage answers (UNAVAILABLE), never 401.
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        await proc.respawn()
        await wait_redis(mesh_redis.state_redis_url, 30)
        codes = []
        for _ in range(3):  # a pooled connection of the dead server fails once, as UNAVAILABLE
            try:
                got = await stub.GetFile(ref, metadata=meta, timeout=10)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
                continue
            assert got.id == upload.id
            break
        else:
            raise AssertionError(f"no answer after the restart: {codes}")
        assert set(codes) <= {grpc.StatusCode.UNAVAILABLE}, codes
