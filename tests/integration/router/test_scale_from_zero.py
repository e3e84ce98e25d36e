"""Scale from zero end to end in one process: a real router (idle policy: min_replicas 0, a short idle_after_s)
and a real edge worker (INT4 model) that registers itself, real gRPC on port 0, real Redis.

The idle sweeper puts the worker to sleep; a request then is held while the router wakes it, and is answered
(a stream and a unary call); 16 requests arriving together at the sleeping model are served by exactly one
wake; ListModels lists the model asleep, then awake.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from services.common.config import load_settings
from services.common.model_state import ModelState
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import RunningServer
from services.common.tokenizer import Tokenizer
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.server import start_edge_worker
from services.router.balancer.core import Router
from services.router.balancer.registry import Replica
from services.router.balancer.wake import Waker
from services.router.config import RouterSettings
from services.router.metrics import HELD, WAKES
from services.router.server import start_router
from services.worker.server import RunningWorker
from tests.integration.router.harness import META, TOKEN, wait_serving

pytestmark = pytest.mark.integration


@dataclass
class Idle:
    router: Router
    server: RunningServer
    worker: RunningWorker
    stub: inference_pb2_grpc.InferenceStub

    @property
    def waker(self) -> Waker:
        assert self.router.waker is not None
        return self.router.waker

    def replica(self) -> Replica:
        (replica,) = self.router.registry.replicas
        return replica

    def wakes(self, outcome: str = "ok") -> float:
        return WAKES.labels(self.waker.model, self.waker.version, outcome)._value.get()  # type: ignore[no-any-return]

    async def state(self) -> str:
        reply = await self.stub.ListModels(pb.ListModelsRequest(), metadata=META)
        return reply.models[0].state

    async def asleep(self, timeout_s: float = 30.0) -> None:
        """Until the sweeper has put the worker to sleep (the router hears it from the Sleep answer)."""

        registry = self.router.registry
        changed = asyncio.Event()
        registry.listeners.append(changed.set)  # told of every registration and change of model state

        async def loop() -> None:
            while not registry.replicas or self.replica().state is not ModelState.ASLEEP:
                await changed.wait()
                changed.clear()

        try:
            await asyncio.wait_for(loop(), timeout_s)
        finally:
            registry.listeners.remove(changed.set)


@pytest.fixture
async def idle(tokenizer: Tokenizer, redis_url: str) -> AsyncIterator[Idle]:
    settings = load_settings(
        RouterSettings,
        redis_url=redis_url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        health_interval_s=0.2,
        idle_min_replicas=0,
        idle_after_s=0.5,
    )
    server, router = await start_router(settings, tokenizer=tokenizer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    worker = await start_edge_worker(
        load_settings(
            EdgeWorkerSettings,
            port=0,
            threads=1,
            max_active_sequences=4,
            worker_id="edge-a",
            internal_token=TOKEN,
            router_address=f"127.0.0.1:{server.port}",
            heartbeat_interval_s=0.2,
            shutdown_grace_s=0,
            warmup=False,
        )
    )
    try:
        await asyncio.wait_for(wait_serving(channel), 30)
        yield Idle(router, server, worker, inference_pb2_grpc.InferenceStub(channel))
    finally:
        await channel.close()
        await worker.stop()
        await server.stop()


async def test_an_idle_worker_sleeps_and_a_held_request_wakes_it_stream_and_unary(idle: Idle) -> None:
    await idle.asleep()
    assert await idle.state() == "asleep"  # still listed
    before = idle.wakes()

    frames: list[pb.GenerateResponse] = []
    listed_while_streaming = ""
    request = pb.GenerateRequest(prompt="Name a colour.", sampling=pb.SamplingParams(max_tokens=8))
    async for frame in idle.stub.Generate(request, metadata=META):
        if not frames:  # the turn is in flight: the model is awake and cannot fall asleep meanwhile
            listed_while_streaming = await idle.state()
        frames.append(frame)
    assert frames[-1].HasField("final") and frames[-1].final.usage.completion_tokens > 0
    assert any(f.text for f in frames)  # the held stream got its tokens
    assert idle.wakes() == before + 1
    assert listed_while_streaming == "awake"

    await idle.asleep()  # idle again: back to sleep
    reply = await idle.stub.Complete(
        pb.GenerateRequest(prompt="Name a fruit.", sampling=pb.SamplingParams(max_tokens=4)), metadata=META
    )
    assert reply.final.usage.completion_tokens > 0
    assert idle.wakes() == before + 2


async def test_16_requests_at_a_sleeping_model_are_served_by_exactly_one_wake(idle: Idle) -> None:
    await idle.asleep()
    before, abandoned = idle.wakes(), idle.wakes("abandoned")
    held = HELD.labels(idle.waker.model, idle.waker.version)

    async def one(i: int) -> pb.GenerateResponse:
        request = pb.GenerateRequest(prompt=f"Count to {i}.", sampling=pb.SamplingParams(max_tokens=3))
        return await idle.stub.Complete(request, metadata=META)

    calls = [asyncio.create_task(one(i)) for i in range(16)]
    replies = await asyncio.gather(*calls)
    assert all(r.final.usage.completion_tokens > 0 for r in replies)
    assert idle.wakes() == before + 1
    assert held._value.get() == 0
    assert idle.wakes("abandoned") == abandoned
