"""Shared fixtures and helpers of the router integration tests (real router, fake workers, real Redis)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import load_settings
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as admin_pb
from services.common.pb.meshserve.internal.v1 import router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import RunningServer
from services.common.tokenizer import Tokenizer
from services.router.balancer.core import Router
from services.router.config import RouterSettings
from services.router.frontend.api import RouterAPI
from services.router.server import start_router, start_router_api
from tests.integration.router.fake_worker import FakeWorker, start_fake

HF_DIR = model_paths().hf_dir
TOKEN = "router-test-token"
META = (("x-meshserve-internal-token", TOKEN), ("x-request-id", "req-1"), ("x-meshserve-tenant", "acme"))
ADMIN_META = (("x-meshserve-internal-token", TOKEN),)
LONG_PROMPT = "Tell me everything about the history of the Roman empire. " * 20


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(HF_DIR)


@dataclass
class Mesh:
    router: Router
    server: RunningServer
    edges: list[FakeWorker]
    cloud: FakeWorker
    stub: inference_pb2_grpc.InferenceStub
    channel: grpc.aio.Channel

    def all(self) -> list[FakeWorker]:
        return [*self.edges, self.cloud]


async def wait_serving(channel: grpc.aio.Channel) -> None:
    """Block until the server's health says SERVING (streamed, no polling)."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    async for resp in stream:
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            stream.cancel()
            return


@pytest.fixture
async def mesh(tokenizer: Tokenizer, redis_url: str) -> AsyncIterator[Mesh]:
    async with open_mesh(tokenizer, redis_url) as opened:
        yield opened


@contextlib.asynccontextmanager
async def open_mesh(tokenizer: Tokenizer, redis_url: str, **router_settings: object) -> AsyncIterator[Mesh]:
    """A real router over two fake edge workers and one cloud, reached over their stream transport
    (services/common/muxwire.py); ``router_settings`` override the router's."""
    edges = [await start_fake(f"edge-{i}", pb.TIER_EDGE, TOKEN) for i in range(2)]
    cloud = await start_fake("cloud-0", pb.TIER_CLOUD, TOKEN)
    settings = load_settings(
        RouterSettings,
        edge_workers=",".join(e.address for e in edges),
        cloud_workers=cloud.address,
        redis_url=redis_url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        cache_retry_after_s=0,
        health_interval_s=0.2,
        eject_base_s=0.001,  # probes may re-admit a failed fake at once
        readmit_s=0,
        stall_timeout_s=1.0,
        **router_settings,
    )
    server, router = await start_router(settings, tokenizer=tokenizer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    await asyncio.wait_for(wait_serving(channel), 10)
    yield Mesh(router, server, edges, cloud, inference_pb2_grpc.InferenceStub(channel), channel)
    await channel.close()
    await server.stop()
    for w in [*edges, cloud]:
        assert w.server is not None
        await w.server.stop()


async def kill_mid_stream(
    mesh: Mesh, kill: Callable[[FakeWorker], Awaitable[None]], routing: pb.RoutingOptions
) -> tuple[list[pb.GenerateResponse], FakeWorker]:
    """A 30-token request whose worker ``kill`` takes away after 3 tokens: every frame, and that worker."""
    for worker in mesh.all():
        worker.token_delay_s = 0.02
    call = mesh.stub.Generate(request("resume me", max_tokens=30, routing=routing), metadata=META)
    frames = []
    async for frame in call:
        frames.append(frame)
        if len([f for f in frames if f.token_ids]) == 3:
            break
    serving = next(w for w in mesh.all() if w.starts)
    await kill(serving)
    frames += [f async for f in call]
    return frames, serving


def request(prompt: str = "Hello there", max_tokens: int = 4, **kw: object) -> pb.GenerateRequest:
    routing = kw.pop("routing", None)
    return pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, **kw),  # type: ignore[arg-type]
        routing=routing,  # type: ignore[arg-type]
    )


async def generate(mesh: Mesh, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [r async for r in mesh.stub.Generate(req, metadata=META)]


def tokens(frames: list[pb.GenerateResponse]) -> list[int]:
    return [t for f in frames for t in f.token_ids]


def final(frames: list[pb.GenerateResponse]) -> pb.Final:
    assert frames[-1].HasField("final")
    assert [f.sequence for f in frames] == list(range(len(frames)))
    return frames[-1].final


W = TypeVar("W")


@dataclass
class ModelsRouter(Generic[W]):
    """A real router serving a models file over the workers ``workers`` (whoever started them stops
    them), with its RouterAdmin and Inference stubs; ``rollout`` changes ``model``'s rollout."""

    api: RouterAPI
    server: RunningServer
    workers: dict[str, W]
    admin: router_admin_pb2_grpc.RouterAdminStub
    stub: inference_pb2_grpc.InferenceStub
    model: str

    async def rollout(self, **fields: object) -> admin_pb.ModelRollout:
        weights = fields.pop("weights", None)
        req = admin_pb.SetRolloutRequest(model=self.model, **fields)  # type: ignore[arg-type]
        if weights is not None:
            req.weights.extend(admin_pb.VersionWeight(version=v, weight=w) for v, w in weights.items())  # type: ignore[attr-defined]
        return await self.admin.SetRollout(req, metadata=ADMIN_META)

    async def listed(self) -> admin_pb.ModelRollout:
        reply = await self.admin.ListRollouts(admin_pb.ListRolloutsRequest(model=self.model), metadata=ADMIN_META)
        return reply.models[0]


@contextlib.asynccontextmanager
async def open_models_router(
    workers: dict[str, W],
    addresses: Iterable[str],
    models_yaml: str,
    tmp: Path,
    model: str,
    tokenizer: Tokenizer | None = None,
    **router_settings: object,
) -> AsyncIterator[ModelsRouter[W]]:
    """Start a router over the edge workers at ``addresses`` with ``models_yaml`` as its models file
    (``router_settings`` add to or override its settings), and wait until every worker is healthy and
    has reported its build."""
    path = tmp / "models.yaml"
    path.write_text(models_yaml)
    settings = load_settings(
        RouterSettings,
        edge_workers=",".join(addresses),
        models_file=str(path),
        internal_token=TOKEN,
        shutdown_grace_s=0,
        health_interval_s=0.2,
        **router_settings,
    )
    server, api = await start_router_api(settings, tokenizer=tokenizer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        await asyncio.wait_for(wait_serving(channel), 30)
        # Serving means one worker is healthy and reported: wait for all of them (and their builds).
        deadline = asyncio.get_running_loop().time() + 60
        while sum(1 for r in api.router.registry.replicas if r.healthy and r.report.model_version) < len(workers):
            assert asyncio.get_running_loop().time() < deadline, "the workers did not all become healthy"
            await asyncio.sleep(0.05)
        admin = router_admin_pb2_grpc.RouterAdminStub(channel)
        yield ModelsRouter(api, server, workers, admin, inference_pb2_grpc.InferenceStub(channel), model)
    finally:
        await channel.close()
        await server.stop()
