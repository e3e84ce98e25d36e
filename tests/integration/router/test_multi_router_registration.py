"""Several router replicas, one worker: the worker registers with every router, from a list of
addresses or from names re-resolved by DNS (how a Kubernetes headless Service lists the replicas).

Two real routers with no static workers and one real edge worker (INT4 model), real gRPC servers on
port 0, real Redis. Each router must list the worker as healthy and route a request to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import grpc
import pytest

from services.common.config import load_settings
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import RunningServer
from services.common.tokenizer import Tokenizer
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.server import start_edge_worker
from services.router.balancer.core import Router
from services.router.config import RouterSettings
from services.router.server import start_router
from tests.integration.router.harness import META, TOKEN, wait_serving

pytestmark = pytest.mark.integration


@pytest.fixture
async def routers(tokenizer: Tokenizer, redis_url: str) -> AsyncIterator[list[tuple[RunningServer, Router]]]:
    async with AsyncExitStack() as stack:
        started = []
        for _ in range(2):
            settings = load_settings(
                RouterSettings,
                redis_url=redis_url,
                internal_token=TOKEN,
                shutdown_grace_s=0,
                heartbeat_ttl_s=2.0,
                health_interval_s=0.2,
            )
            server, router = await start_router(settings, tokenizer=tokenizer)
            stack.push_async_callback(server.stop)
            assert router.registry.replicas == []  # nothing static: the worker must register itself
            started.append((server, router))
        yield started


async def generate_through(server: RunningServer) -> pb.Final:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        await asyncio.wait_for(wait_serving(channel), 30)  # SERVING once a registered worker is healthy
        request = pb.GenerateRequest(
            prompt="Say hi",
            sampling=pb.SamplingParams(max_tokens=2, temperature=0.0),
            routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
        )
        frames = [f async for f in inference_pb2_grpc.InferenceStub(channel).Generate(request, metadata=META)]
    assert frames[-1].HasField("final")
    return frames[-1].final


@pytest.mark.parametrize("mode", ["list", "dns"])
async def test_one_worker_registers_with_every_router(routers: list[tuple[RunningServer, Router]], mode: str) -> None:
    ports = [server.port for server, _ in routers]
    if mode == "list":
        extra: dict[str, object] = {"router_address": ",".join(f"127.0.0.1:{p}" for p in ports)}
    else:  # names resolved by real DNS (getaddrinfo) every round, as with a headless Service's name
        extra = {"router_address": ",".join(f"localhost:{p}" for p in ports), "router_resolve": True}
    settings = load_settings(
        EdgeWorkerSettings,
        port=0,
        threads=1,
        max_active_sequences=1,
        worker_id="edge-solo",
        internal_token=TOKEN,
        heartbeat_interval_s=0.2,
        shutdown_grace_s=0,
        warmup=False,
        **extra,
    )
    worker = await start_edge_worker(settings)
    try:
        assert worker.heartbeater is not None
        await asyncio.wait_for(worker.heartbeater.wait_routers(2), 30)
        assert sorted(worker.heartbeater.routers) == sorted(f"127.0.0.1:{p}" for p in ports)
        for server, router in routers:
            final = await generate_through(server)
            assert final.route.worker_id == "edge-solo"
            assert [(r.address, r.healthy) for r in router.registry.replicas] == [(f"127.0.0.1:{worker.port}", True)]
    finally:
        await worker.stop()
    for _, router in routers:  # the goodbye reached every router: none keeps the worker
        assert router.registry.replicas == []
