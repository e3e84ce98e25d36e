"""RouterAdmin.PrefixLocation with a real router, a real cloud worker (the real model on CPU) and Redis.

After a greedy request the worker holds the prompt's blocks (its load report says so) and has
exported them to Redis on finish; an unseen prompt is held nowhere. `meshserve cache where` prints it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from services.cli.cache import main as cache_cli
from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as admin_pb
from services.common.pb.meshserve.internal.v1 import router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import RunningServer
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.server import start_gpu_worker
from services.router.balancer.core import Router
from services.router.config import RouterSettings
from services.router.server import start_router
from services.worker.server import RunningWorker
from tests.helpers import RedisServer
from tests.integration.router.harness import wait_serving

pytestmark = pytest.mark.integration

TOKEN = "prefix-location-token"
ADMIN = (("x-meshserve-internal-token", TOKEN),)
PROMPT = (
    "You are a patient physics teacher. A student asks you a question on a field trip to the coast. "
    "Explain, in one short sentence, why the sky looks blue on a clear summer afternoon at the sea."
)


@dataclass
class Mesh:
    router: Router
    server: RunningServer
    worker: RunningWorker
    admin: router_admin_pb2_grpc.RouterAdminStub
    inference: inference_pb2_grpc.InferenceStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@pytest.fixture(scope="module")
async def mesh(redis_srv: RedisServer) -> AsyncIterator[Mesh]:
    worker = await start_gpu_worker(
        load_settings(
            GpuWorkerSettings,
            port=0,
            threads=1,
            device="cpu",
            max_active_sequences=2,
            kv_budget_bytes=64 << 20,
            worker_id="cloud-loc",
            redis_url=redis_srv.url,
            internal_token=TOKEN,
        )
    )
    settings = load_settings(
        RouterSettings,
        cloud_workers=f"127.0.0.1:{worker.port}",
        redis_url=redis_srv.url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        health_interval_s=0.2,
    )
    server, router = await start_router(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    await asyncio.wait_for(wait_serving(channel), 30)
    yield Mesh(
        router,
        server,
        worker,
        router_admin_pb2_grpc.RouterAdminStub(channel),
        inference_pb2_grpc.InferenceStub(channel),
    )
    await channel.close()
    await server.stop()
    await worker.stop()


def _ask(text: str = PROMPT, tenant: str = "acme", **kw: object) -> admin_pb.PrefixLocationRequest:
    kw.setdefault("tier", pb.TIER_CLOUD)
    return admin_pb.PrefixLocationRequest(text=text, tenant=tenant, **kw)  # type: ignore[arg-type]


async def _until_exported(mesh: Mesh, want: int, timeout_s: float = 30.0) -> admin_pb.PrefixLocationResponse:
    """PrefixLocation once the worker's export reached Redis and its load report lists the blocks."""
    deadline = time.monotonic() + timeout_s
    while True:
        # A fresh report from the worker replaces what the router remembers sending it: the count
        # below is then what the worker itself says it holds.
        await mesh.router.registry.probe_all()
        reply = await mesh.admin.PrefixLocation(_ask(), metadata=ADMIN, timeout=10)
        if reply.redis_blocks == want and [r.cached_blocks for r in reply.replicas] == [want]:
            return reply
        if time.monotonic() > deadline:
            raise AssertionError(f"the prompt's {want} blocks were not reported and exported in time: {reply}")
        await asyncio.sleep(0.05)  # the export is fire-and-forget on the worker: poll its result, bounded


async def test_a_served_prompt_is_held_by_its_worker_and_in_redis(
    mesh: Mesh, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    unseen = await mesh.admin.PrefixLocation(_ask(), metadata=ADMIN, timeout=10)
    assert unseen.prompt_blocks >= 2 and unseen.block_tokens == 16
    assert [(r.worker_id, r.cached_blocks) for r in unseen.replicas] == [("cloud-loc", 0)]
    assert unseen.redis == admin_pb.REDIS_LOOKUP_ANSWERED and unseen.redis_blocks == 0
    assert (unseen.tier, unseen.tier_reason) == (pb.TIER_CLOUD, "requested")

    request = pb.GenerateRequest(
        prompt=PROMPT,
        sampling=pb.SamplingParams(max_tokens=2),
        routing=pb.RoutingOptions(tier=pb.TIER_CLOUD, cache_policy=pb.CACHE_POLICY_BYPASS),
    )
    meta = (*ADMIN, ("x-request-id", "loc-1"), ("x-meshserve-tenant", "acme"))
    frames = [f async for f in mesh.inference.Generate(request, metadata=meta, timeout=60)]
    assert frames[-1].final.route.worker_id == "cloud-loc"
    assert frames[-1].final.usage.prompt_tokens == unseen.prompt_tokens  # tokenized as Generate does

    held = await _until_exported(mesh, unseen.prompt_blocks)
    assert held.model_version == mesh.router.model_version and held.redis_block_tokens == 16
    other_tenant = await mesh.admin.PrefixLocation(_ask(tenant="globex"), metadata=ADMIN, timeout=10)
    assert other_tenant.redis_blocks == 0 and [r.cached_blocks for r in other_tenant.replicas] == [0]
    shared = await mesh.admin.PrefixLocation(_ask(shareable_prefix=True), metadata=ADMIN, timeout=10)
    assert shared.redis_blocks == 0
    fresh = await mesh.admin.PrefixLocation(_ask("A completely different question: " * 3), metadata=ADMIN, timeout=10)
    assert fresh.prompt_blocks >= 1 and fresh.redis_blocks == 0 and [r.cached_blocks for r in fresh.replicas] == [0]

    # `meshserve cache where` prints the same answer as a table.
    argv = ["--internal-token", TOKEN, "where", PROMPT, "--tenant", "acme", "--tier", "cloud", "--router", mesh.address]
    capsys.readouterr()
    assert await asyncio.to_thread(cache_cli, argv) == 0
    lines = capsys.readouterr().out.splitlines()
    blocks = str(held.prompt_blocks)
    assert f"prompt: {held.prompt_tokens} tokens, {blocks} full blocks of 16 tokens" in lines
    assert "tier:   cloud (requested)" in lines
    assert next(line for line in lines if line.startswith("cloud-loc")).split()[-1] == blocks
    assert next(line for line in lines if line.startswith("redis ")).split()[-1] == blocks


async def test_bad_input_and_a_missing_credential_are_refused(mesh: Mesh) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await mesh.admin.PrefixLocation(admin_pb.PrefixLocationRequest(), metadata=ADMIN, timeout=10)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in (empty.value.details() or "")
    too_long = _ask("word " * 9000)  # beyond the 8192-token context
    with pytest.raises(grpc.aio.AioRpcError) as long:
        await mesh.admin.PrefixLocation(too_long, metadata=ADMIN, timeout=30)
    assert long.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in (long.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as anon:
        await mesh.admin.PrefixLocation(_ask(), timeout=10)
    assert anon.value.code() == grpc.StatusCode.PERMISSION_DENIED  # like every internal call without it
    edge = await mesh.admin.PrefixLocation(_ask(tier=pb.TIER_EDGE), metadata=ADMIN, timeout=10)
    assert edge.tier == pb.TIER_EDGE and list(edge.replicas) == []  # no edge replica: a query, not an error
