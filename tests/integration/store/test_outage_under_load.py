"""Redis killed and restarted in the middle of a load of router requests: none fails, hits come back.

The real router (port 0) with fake workers and its own redis-server; a bounded load of deterministic
requests over 6 prompts, 8 at a time. Redis is stopped when request 80 is issued and started again
at request 160 (once 20 requests have run entirely while it was down); requests that ran entirely while Redis was down
must all be misses; the load then goes on until 40 requests in a row were answered after the restart
with a hit ratio of at least 0.8, or fails at MAX_REQUESTS (the breaker's probe interval is
time-based, so the number of requests recovery takes depends on the machine's speed).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import load_settings
from services.common.model_paths import model_paths
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.tokenizer import Tokenizer
from services.router.config import RouterSettings
from services.router.server import start_router
from tests.helpers import RedisServer, free_port
from tests.integration.router.fake_worker import start_fake

HF_DIR = model_paths().hf_dir
TOKEN = "cache-outage-token"
META = (("x-meshserve-internal-token", TOKEN), ("x-meshserve-tenant", "acme"))
MAX_REQUESTS, STOP_AT, START_AT, CONCURRENCY, WINDOW = 3000, 80, 160, 8, 40
PROMPTS = [f"Question number {i}: what is the sea?" for i in range(6)]

pytestmark = [
    pytest.mark.integration,
]


@dataclass
class Outcome:
    index: int
    ok: bool
    hit: bool
    error: str = ""
    while_down: bool = False
    """The request started after Redis had stopped and ended before its restart began."""


@pytest.fixture
async def router_stub(tmp_path: object) -> AsyncIterator[tuple[inference_pb2_grpc.InferenceStub, RedisServer]]:
    redis = RedisServer(port=free_port(), dir=str(tmp_path))
    redis.start()
    workers = [await start_fake("edge-0", pb.TIER_EDGE, TOKEN), await start_fake("cloud-0", pb.TIER_CLOUD, TOKEN)]
    settings = load_settings(
        RouterSettings,
        edge_workers=workers[0].address,
        cloud_workers=workers[1].address,
        redis_url=redis.url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        cache_timeout_s=0.25,
        cache_retry_after_s=0.1,
        health_interval_s=0.2,
    )
    server, _router = await start_router(settings, tokenizer=Tokenizer(HF_DIR))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    async for reply in health:
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            health.cancel()
            break
    try:
        yield inference_pb2_grpc.InferenceStub(channel), redis
    finally:
        await channel.close()
        await server.stop()
        for w in workers:
            assert w.server is not None
            await w.server.stop()
        redis.stop()


async def test_redis_restart_mid_load(router_stub: tuple[inference_pb2_grpc.InferenceStub, RedisServer]) -> None:
    stub, redis = router_stub
    outcomes: list[Outcome] = []
    issued = 0
    stopped, restarting, restarted = asyncio.Event(), asyncio.Event(), asyncio.Event()
    down_enough = asyncio.Event()  # 20 requests ran entirely while Redis was down
    served_while_down = 0

    async def one(i: int) -> Outcome:
        req = pb.GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], sampling=pb.SamplingParams(max_tokens=4))
        down_at_start = stopped.is_set() and not restarting.is_set()
        try:
            frames = [f async for f in stub.Generate(req, metadata=META, timeout=10)]
        except grpc.aio.AioRpcError as exc:
            return Outcome(i, False, False, f"{exc.code().name}: {exc.details()}")
        last = frames[-1]
        while_down = down_at_start and not restarting.is_set()
        if while_down:
            nonlocal served_while_down
            served_while_down += 1
            if served_while_down >= 20:
                down_enough.set()
        return Outcome(i, last.HasField("final"), last.final.route.cache_hit, while_down=while_down)

    after_restart: list[Outcome] = []

    def recovered() -> bool:
        tail = after_restart[-WINDOW:]
        return len(tail) == WINDOW and sum(o.hit for o in tail) >= 0.8 * WINDOW

    async def client() -> None:
        nonlocal issued
        while issued < MAX_REQUESTS and not recovered():
            i = issued
            issued += 1
            if i == STOP_AT:
                await asyncio.to_thread(redis.stop)  # killed while the other clients keep sending
                stopped.set()
            if i == START_AT:
                await stopped.wait()  # never start while the stop is still in progress
                await asyncio.wait_for(down_enough.wait(), 60)  # the other clients keep the load on
                restarting.set()
                await asyncio.to_thread(redis.start)
                restarted.set()
            outcome = await one(i)
            outcomes.append(outcome)
            if restarted.is_set() and i > START_AT:
                after_restart.append(outcome)

    await asyncio.wait_for(asyncio.gather(*(client() for _ in range(CONCURRENCY))), 240)
    assert stopped.is_set() and restarted.is_set()
    outcomes.sort(key=lambda o: o.index)
    assert [(o.index, o.error) for o in outcomes if not o.ok] == []  # no request failed because the cache did

    def ratio(lo: int, hi: int) -> float:
        window = outcomes[lo:hi]
        return sum(o.hit for o in window) / len(window)

    before = ratio(20, STOP_AT)
    assert before >= 0.8
    down = [o for o in outcomes if o.while_down]
    assert len(down) >= 10, "some requests must run while Redis is down"
    assert not any(o.hit for o in down)  # Redis is down: misses, served by the workers
    assert recovered(), f"hit ratio did not recover within {MAX_REQUESTS} requests"
