"""`meshserve up`'s default layout with real processes: the gateway carries the router, the real edge
workers register with the router's port in the gateway process, and a prompt is answered through it.
"""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import router_admin_pb2, router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import Mesh, MeshConfig
from tests.e2e.conftest import auth
from tests.helpers import RedisServer


def _sink(name: str, line: str) -> None:
    if '"level": "error"' in line or "Traceback" in line:
        sys.stderr.write(f"{name} | {line}\n")


@pytest.fixture(scope="module")
async def mesh(redis_srv: RedisServer) -> AsyncIterator[Mesh]:
    config = MeshConfig(edge_workers=2, cloud_workers=0, redis_url=redis_srv.url, embed_router=True)
    async with Mesh(config, sink=_sink) as running:
        yield running


async def test_the_mesh_answers_through_the_gateways_own_router(mesh: Mesh) -> None:
    assert "router" not in mesh.processes  # no router process: it runs in the gateway's
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(prompt="Tell me about the sea.", sampling=pb.SamplingParams(max_tokens=12))
        frames = [f async for f in stub.Generate(request, metadata=auth(), timeout=60)]
    final = frames[-1].final
    assert final.usage.completion_tokens > 0 and "".join(f.text for f in frames).strip()
    assert final.route.tier == pb.TIER_EDGE and final.route.worker_id in {"edge-0", "edge-1"}
    async with grpc.aio.insecure_channel(mesh.router_address) as channel:  # the embedded router's own port
        reply = await router_admin_pb2_grpc.RouterAdminStub(channel).ListReplicas(
            router_admin_pb2.ListReplicasRequest(),
            metadata=(("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),),
            timeout=5,
        )
    assert {r.worker_id for r in reply.replicas} == {"edge-0", "edge-1"}  # both registered by heartbeat
    # The router's metrics are the gateway process's (what benchmarks scrape via router_process).
    assert mesh.router_process is mesh.processes["gateway"]
    port = mesh.router_process.metrics_port
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read())
    assert b"meshserve_router_replica_decisions_total{" in body


LIGHTHOUSE = "We are sailing along a rocky coast at night in thick fog. Where is the nearest lighthouse from here?"


async def test_the_embedded_router_locates_prefixes(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    """RouterAdmin.PrefixLocation (`meshserve cache where`) is served in this layout as well."""
    from services.cli.cache import main as cache_cli

    async with grpc.aio.insecure_channel(mesh.router_address) as channel:
        reply = await router_admin_pb2_grpc.RouterAdminStub(channel).PrefixLocation(
            router_admin_pb2.PrefixLocationRequest(text=LIGHTHOUSE),
            metadata=(("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),),
            timeout=10,
        )
    assert (reply.tier, reply.tier_reason) == (pb.TIER_EDGE, "prompt_short")  # the router's own choice
    assert {r.worker_id for r in reply.replicas} == {"edge-0", "edge-1"} and reply.prompt_blocks >= 1
    assert reply.redis == router_admin_pb2.REDIS_LOOKUP_ANSWERED and reply.redis_blocks == 0  # edge exports none
    argv = ["where", "Where is the nearest lighthouse?", "--router", mesh.router_address]
    capsys.readouterr()
    assert await asyncio.to_thread(cache_cli, argv) == 0
    out = capsys.readouterr().out
    assert "tier:   edge (prompt_short)" in out and "edge-0" in out and "edge-1" in out


async def test_embed_without_a_cloud_worker_is_unavailable(mesh: Mesh) -> None:
    """Embeddings come from the cloud tier only: with edge workers alone the embedded router says so."""
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = pb.EmbedRequest(inputs=[pb.EmbedInput(text="The sea")])
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(request, metadata=auth(), timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy cloud worker can serve embeddings" in (caught.value.details() or "")
