"""Self-registration end to end in one process: a real router with no static workers, real edge workers
(INT4 model) started with the router's address, real gRPC servers on port 0, real Redis.

Workers join by heartbeat and get traffic; their load reports (held chat → hot prefix blocks in the
KV cache's hash scheme) reach the router's policy; a worker that says goodbye is removed at once, and
one whose heartbeats stop is removed after the TTL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.sampling import SamplingParams
from services.common.serving import RunningServer
from services.common.tokenizer import Tokenizer
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.server import start_edge_worker
from services.router.balancer.core import Router
from services.router.balancer.registry import Registry
from services.router.balancer.tiers import TierName
from services.router.config import RouterSettings
from services.router.metrics import REPLICA_DECISIONS
from services.router.server import start_router
from services.router.types import TurnRequest
from services.worker.server import RunningWorker
from tests.integration.router.harness import META, TOKEN, wait_serving

pytestmark = pytest.mark.integration
TENANT = "acme"  # META's tenant


@dataclass
class Cluster:
    router: Router
    server: RunningServer
    workers: dict[str, RunningWorker]
    stub: inference_pb2_grpc.InferenceStub
    channel: grpc.aio.Channel

    @property
    def registry(self) -> Registry:
        return self.router.registry

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.workers[name].port}"


@pytest.fixture
async def cluster(tokenizer: Tokenizer, redis_url: str) -> AsyncIterator[Cluster]:
    settings = load_settings(
        RouterSettings,
        redis_url=redis_url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        heartbeat_ttl_s=1.0,
        health_interval_s=0.2,
    )
    server, router = await start_router(settings, tokenizer=tokenizer)
    assert router.registry.replicas == []  # nothing static: everything below registers itself
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    workers: dict[str, RunningWorker] = {}
    try:
        for name in ("edge-a", "edge-b"):
            worker_settings = load_settings(
                EdgeWorkerSettings,
                port=0,
                threads=1,
                max_active_sequences=2,
                worker_id=name,
                internal_token=TOKEN,
                router_address=f"127.0.0.1:{server.port}",
                heartbeat_interval_s=0.2,
                shutdown_grace_s=0,
                warmup=False,
            )
            workers[name] = await start_edge_worker(worker_settings)
        await asyncio.wait_for(wait_serving(channel), 30)  # SERVING once a registered worker is healthy
        yield Cluster(router, server, workers, inference_pb2_grpc.InferenceStub(channel), channel)
    finally:
        await channel.close()
        for worker in workers.values():
            await worker.stop()
        await server.stop()


async def _until(condition: object, registry: Registry, timeout_s: float = 15.0) -> None:
    """Probe the registry until ``condition()`` holds (bounded)."""

    async def loop() -> None:
        while not condition():  # type: ignore[operator]
            await registry.probe_all()
            await asyncio.sleep(0.05)  # polling router state that heartbeats change

    await asyncio.wait_for(loop(), timeout_s)


def _replica_names(registry: Registry) -> set[str]:
    return {r.name for r in registry.replicas if r.healthy}


async def test_workers_register_get_traffic_and_their_hot_prefix_reaches_the_policy(cluster: Cluster) -> None:
    registry = cluster.registry
    await _until(lambda: _replica_names(registry) == {"edge-a", "edge-b"}, registry)
    assert all(r.registered_until > 0 for r in registry.replicas)  # self-registered, not static

    served = set()
    for i in range(4):
        frames = [
            f
            async for f in cluster.stub.Generate(
                pb.GenerateRequest(prompt=f"Count to {i}.", sampling=pb.SamplingParams(max_tokens=3)), metadata=META
            )
        ]
        assert frames[-1].HasField("final")
        served.add(frames[-1].final.route.worker_id)
    assert served <= {"edge-a", "edge-b"} and served

    # A chat held on edge-b by a client the router never saw (another router, say): 64 prompt tokens.
    prompt = cluster.router.tokenizer.encode("Tell me a long story about the sea and the ships on it. " * 6)[:64]
    async with grpc.aio.insecure_channel(cluster.address("edge-b")) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Generate(metadata=META)
        start = worker_pb2.WorkerStart(prompt_token_ids=prompt, tenant=TENANT, sampling=pb.SamplingParams(max_tokens=2))
        await call.write(worker_pb2.WorkerRequest(start=start))
        while not (await call.read()).HasField("final"):
            pass
        b = next(r for r in registry.replicas if r.name == "edge-b")
        # Wait for the report that holds this chat: an earlier one may still show edge-b holding one
        # of the router's short turns above (held 1, 7 tokens) and not this chat yet.
        await _until(lambda: b.report.held_sequences >= 1 and b.report.kv_tokens >= len(prompt), registry)
        assert b.report.block_tokens == 16

        req = TurnRequest(
            prompt_ids=[*prompt, *prompt[:20]],
            sampling=SamplingParams(max_tokens=4),
            hint=TierName.EDGE,
            use_cache=False,
            shareable=False,
            tenant=TENANT,
            request_id="r",
        )
        blocks = cluster.router.blocks(req)
        assert set(blocks[:4]) <= b.hot_blocks  # the router's hashes equal the worker's reported ones
        cluster.router.selector.forget(b.address)  # only the report can say where this prefix lives
        before = REPLICA_DECISIONS.labels("edge", "prefix")._value.get()
        assert cluster.router.select(req, TierName.EDGE, []).name == "edge-b"
        assert REPLICA_DECISIONS.labels("edge", "prefix")._value.get() == before + 1
        await call.done_writing()


async def test_leaving_worker_is_removed_at_once_and_a_silent_one_after_the_ttl(cluster: Cluster) -> None:
    registry = cluster.registry
    await _until(lambda: _replica_names(registry) == {"edge-a", "edge-b"}, registry)
    a_address = cluster.address("edge-a")

    await cluster.workers.pop("edge-b").stop()  # graceful: says it is leaving before draining
    assert _replica_names(registry) == {"edge-a"}
    assert all(r.name != "edge-b" for r in registry.replicas)

    hb = cluster.workers["edge-a"].heartbeater
    assert hb is not None
    await hb.stop()  # vanishes without a goodbye (the process would have been killed)
    await _until(lambda: not registry.replicas, registry, timeout_s=10)
    assert a_address not in {r.address for r in registry.replicas}
    with pytest.raises(grpc.aio.AioRpcError) as err:  # nobody left to serve
        await cluster.stub.Complete(
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)), metadata=META
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
