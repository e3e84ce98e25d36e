"""`meshserve status` reads a worker's load and token counters when it draws the frame, not from the
router's heartbeat copy: a real router and a real edge worker (INT4 model) whose heartbeats and
health probes are 30 s apart, so the router's view stays what it was at registration."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.cli.status import gather
from services.common.config import load_settings
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.tokenizer import Tokenizer
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.server import start_edge_worker
from services.router.config import RouterSettings
from services.router.server import start_router
from tests.integration.router.harness import META, TOKEN, tokenizer, wait_serving

pytestmark = pytest.mark.integration
__all__ = ["tokenizer"]
SLOW_S = 30.0


@pytest.fixture
async def router_address(tokenizer: Tokenizer, redis_url: str) -> AsyncIterator[str]:
    settings = load_settings(
        RouterSettings,
        redis_url=redis_url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        heartbeat_ttl_s=3 * SLOW_S,
        health_interval_s=SLOW_S,
    )
    server, _router = await start_router(settings, tokenizer=tokenizer)
    address = f"127.0.0.1:{server.port}"
    worker_settings = load_settings(
        EdgeWorkerSettings,
        port=0,
        threads=1,
        max_active_sequences=2,
        worker_id="edge-slow-reports",
        internal_token=TOKEN,
        router_address=address,
        heartbeat_interval_s=SLOW_S,
        shutdown_grace_s=0,
        warmup=False,
    )
    worker = await start_edge_worker(worker_settings)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(wait_serving(channel), 30)
        yield address
    finally:
        await worker.stop()
        await server.stop()


async def test_status_shows_a_running_stream_at_once(router_address: str) -> None:
    idle = await gather(router_address, token=TOKEN)
    assert [(r.active, r.tokens_total) for r in idle.replicas] == [(0, 0)], idle
    request = pb.GenerateRequest(
        prompt="Count from 1 to 100, separated by commas:", sampling=pb.SamplingParams(max_tokens=64, temperature=0)
    )
    async with grpc.aio.insecure_channel(router_address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(request, metadata=META)
        try:
            frames = aiter(call)
            await anext(frames)  # the stream holds a slot and has produced a token
            first = await gather(router_address, token=TOKEN, previous=idle)
            (replica,) = first.replicas
            assert replica.active == 1, replica  # the router's heartbeat copy still says 0
            assert replica.tokens_total is not None and replica.tokens_total >= 1
            for _ in range(4):
                await anext(frames)
            second = await gather(router_address, token=TOKEN, previous=first)
            (later,) = second.replicas
            assert later.tokens_total is not None and later.tokens_total > replica.tokens_total
            assert later.stats_at is not None and replica.stats_at is not None
            expected = (later.tokens_total - replica.tokens_total) / (later.stats_at - replica.stats_at)
            assert later.tokens_per_s == pytest.approx(expected)
        finally:
            call.cancel()
