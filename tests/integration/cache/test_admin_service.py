"""The cache admin service on port 0 against a real Redis: stats, flush by tenant/model/version, warm."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from services.cache.config import CacheSettings
from services.cache.server import start_cache_service
from services.common.config import load_settings
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import cache_pb2, cache_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer
from services.router.config import RouterSettings
from services.router.server import start_router
from services.store.connection import redis_from_url
from services.store.guard import Guard
from services.store.keys import response_key
from services.store.kv_blocks import KVBlockStore, KVContext
from services.store.response_cache import CachedResponse, Finish, ResponseCache
from tests.integration.router.fake_worker import start_fake

pytestmark = pytest.mark.integration
TOKEN = "cache-admin-token"
META = (("x-meshserve-internal-token", TOKEN),)
HF_DIR = model_paths().hf_dir
RESP = CachedResponse((1, 2), "ok", Finish.STOP, 3, 2)


def rkey(tenant: str, version: str = "v1", shareable: bool = False, prompt: int = 0) -> str:
    return response_key(
        model_id="m",
        model_version=version,
        tier="edge",
        tokenizer_id="t",
        sampling=SamplingParams(max_tokens=2),
        prompt_ids=[prompt, 1, 2],
        tenant=tenant,
        shareable=shareable,
    )


async def serve(redis_url: str, router_address: str = "") -> tuple[object, cache_pb2_grpc.CacheStub, grpc.aio.Channel]:
    settings = load_settings(
        CacheSettings, redis_url=redis_url, router_address=router_address, internal_token=TOKEN, shutdown_grace_s=0
    )
    server = await start_cache_service(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return server, cache_pb2_grpc.CacheStub(channel), channel


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[cache_pb2_grpc.CacheStub]:
    server, stub, channel = await serve(redis_url)
    yield stub
    await channel.close()
    await server.stop()  # type: ignore[attr-defined]


@pytest.fixture
async def filled(redis_url: str) -> AsyncIterator[ResponseCache]:
    guard = Guard(redis_from_url(redis_url, 1.0), timeout_s=1.0)
    cache = ResponseCache(guard, ttl_s=60)
    kv = KVBlockStore(guard, block_tokens=4)
    for tenant in ("a", "b"):
        for i in range(3):
            assert await cache.put(rkey(tenant, prompt=i), RESP)
        assert await kv.put(KVContext("m", "v1", tenant), list(range(8)), [np.zeros((2, 4), np.float16)] * 2) == 2
    assert await cache.put(rkey("a", version="v2"), RESP)
    assert await cache.put(rkey("a", shareable=True), RESP)
    assert await cache.get(rkey("a")) == RESP and await cache.get(rkey("zz")) is None
    await guard.flush_stats()
    yield cache
    await guard.close()


async def test_stats_by_kind(admin: cache_pb2_grpc.CacheStub, filled: ResponseCache) -> None:
    stats = await admin.Stats(cache_pb2.CacheStatsRequest(), metadata=META)
    kinds = {k.kind: k for k in stats.kinds}
    resp, kv = kinds[cache_pb2.CACHE_KIND_RESPONSE], kinds[cache_pb2.CACHE_KIND_KV]
    assert (resp.hits, resp.misses, resp.stored) == (1, 1, 8) and resp.hit_ratio == pytest.approx(0.5)
    assert resp.entries == 8 and resp.scopes == 4 and resp.bytes > 0
    assert (kv.stored, kv.entries, kv.scopes) == (4, 4, 2) and kv.bytes > 0
    assert stats.redis_maxmemory_policy == "allkeys-lru" and stats.redis_maxmemory_bytes > 0


async def test_flush_by_tenant_model_version_and_shared(admin: cache_pb2_grpc.CacheStub, filled: ResponseCache) -> None:
    kv = KVBlockStore(filled.guard, block_tokens=4)
    reply = await admin.Flush(cache_pb2.FlushRequest(tenant="a"), metadata=META)
    assert reply.keys_deleted > 0
    assert await filled.get(rkey("a")) is None and await filled.get(rkey("a", version="v2")) is None
    assert await kv.match(KVContext("m", "v1", "a"), list(range(8))) == 0
    assert await filled.get(rkey("b")) == RESP and await kv.match(KVContext("m", "v1", "b"), list(range(8))) == 2
    assert await filled.get(rkey("x", shareable=True)) == RESP  # shared entries are not the tenant's
    await admin.Flush(cache_pb2.FlushRequest(shared=True), metadata=META)
    assert await filled.get(rkey("x", shareable=True)) is None
    await admin.Flush(
        cache_pb2.FlushRequest(model_id="m", model_version="v1", kind=cache_pb2.CACHE_KIND_KV), metadata=META
    )
    assert await kv.match(KVContext("m", "v1", "b"), list(range(8))) == 0 and await filled.get(rkey("b")) == RESP
    await admin.Flush(cache_pb2.FlushRequest(all=True), metadata=META)
    assert await filled.get(rkey("b")) is None


async def test_flush_without_filter_and_calls_without_token_are_refused(admin: cache_pb2_grpc.CacheStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.Flush(cache_pb2.FlushRequest(), metadata=META)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.Stats(cache_pb2.CacheStatsRequest())
    assert err.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.Warm(cache_pb2.WarmRequest(prompts=["hi"]), metadata=META)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # no router configured


async def test_warm_fills_the_shared_cache(redis_url: str) -> None:
    edge = await start_fake("edge-0", pb.TIER_EDGE, TOKEN)
    settings = load_settings(
        RouterSettings, edge_workers=edge.address, redis_url=redis_url, internal_token=TOKEN, shutdown_grace_s=0
    )
    router, _ = await start_router(settings, tokenizer=Tokenizer(HF_DIR))
    server, stub, channel = await serve(redis_url, f"127.0.0.1:{router.port}")
    router_channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    try:
        reply = await stub.Warm(
            cache_pb2.WarmRequest(prompts=["You are a helpful bot.", " "], max_tokens=3), metadata=META
        )
        assert (reply.warmed, reply.failed) == (1, 0)
        assert len(edge.starts) == 1
        request = pb.GenerateRequest(
            prompt="You are a helpful bot.",
            sampling=pb.SamplingParams(max_tokens=3),
            routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_SHAREABLE_PREFIX),
        )
        meta = (*META, ("x-meshserve-tenant", "any-tenant"))
        frames = [f async for f in inference_pb2_grpc.InferenceStub(router_channel).Generate(request, metadata=meta)]
        assert frames[-1].final.route.cache_hit and len(edge.starts) == 1
    finally:
        await router_channel.close()
        await channel.close()
        await server.stop()  # type: ignore[attr-defined]
        await router.stop()
        assert edge.server is not None
        await edge.server.stop()


async def test_warm_is_bounded_and_stops_at_the_callers_deadline(redis_url: str) -> None:
    # A slow worker: 3 prompts x 40 tokens x 50 ms would take 6 s; the caller allows 1 s.
    edge = await start_fake("edge-0", pb.TIER_EDGE, TOKEN, token_delay_s=0.05)
    settings = load_settings(
        RouterSettings, edge_workers=edge.address, redis_url=redis_url, internal_token=TOKEN, shutdown_grace_s=0
    )
    router, _ = await start_router(settings, tokenizer=Tokenizer(HF_DIR))
    cache_settings = load_settings(
        CacheSettings,
        redis_url=redis_url,
        router_address=f"127.0.0.1:{router.port}",
        internal_token=TOKEN,
        shutdown_grace_s=0,
        warm_max_prompts=3,
        warm_max_tokens=40,
    )
    server = await start_cache_service(cache_settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = cache_pb2_grpc.CacheStub(channel)
    try:
        for request, message in (
            (cache_pb2.WarmRequest(prompts=["a", "b", "c", "d"]), "give at most 3 prompts per warm call (4 given)"),
            (cache_pb2.WarmRequest(prompts=["a"], max_tokens=41), "max_tokens of a warm call is at most 40"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Warm(request, metadata=META)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (err.value.details() or "")
        assert not edge.starts  # refused before anything was sent
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Warm(cache_pb2.WarmRequest(prompts=["a", "b", "c"], max_tokens=40), metadata=META, timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert loop.time() - started < 2.0
        # The prompt being generated is cancelled on the worker, and no later prompt is sent.
        await asyncio.wait_for(edge.cancelled.wait(), 5.0)
        await asyncio.sleep(0.5)
        assert len(edge.starts) == 1
    finally:
        await channel.close()
        await server.stop()
        await router.stop()
        assert edge.server is not None
        await edge.server.stop()
