"""`meshserve up --gateways 2`: two gateway replicas, each with its own embedded router that the
worker heartbeats to, both behind Envoy, which balances over them; the mesh stops cleanly."""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.pb.meshserve.internal.v1 import router_admin_pb2, router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.settings import DEFAULT_INTERNAL_TOKEN
from services.controlplane.xds import GRPC_CLUSTER
from services.local.mesh import Mesh, MeshConfig
from tests.e2e.conftest import auth
from tests.helpers import RedisServer

REQUEST = pb.GenerateRequest(  # past the response cache (shared in Redis): every request reaches the worker
    prompt="Tell me about the sea.",
    sampling=pb.SamplingParams(max_tokens=4),
    routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
)


def _sink(name: str, line: str) -> None:
    if '"level": "error"' in line or "Traceback" in line:
        sys.stderr.write(f"{name} | {line}\n")


@pytest.fixture(scope="module")
async def mesh(redis_srv: RedisServer) -> AsyncIterator[Mesh]:
    config = MeshConfig(edge_workers=1, cloud_workers=0, redis_url=redis_srv.url, gateways=2, envoy=True)
    async with Mesh(config, sink=_sink) as running:
        yield running


def _gateway_requests(mesh: Mesh, name: str) -> float:
    """Generate calls the gateway replica ``name`` has finished (its own /metrics)."""
    port = mesh.processes[name].metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "meshserve_request_duration_seconds_count" and sample.labels.get("service") == "gateway"
    )


async def _answer(address: str) -> pb.GenerateResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        frames = [
            f async for f in inference_pb2_grpc.InferenceStub(channel).Generate(REQUEST, metadata=auth(), timeout=60)
        ]
    return frames[-1]


async def test_each_replica_has_a_router_the_worker_registered_with_and_answers(mesh: Mesh) -> None:
    assert mesh.gateway_addresses[0] == mesh.gateway_address and len(set(mesh.gateway_addresses)) == 2
    assert set(mesh.processes) >= {"gateway", "gateway-1"} and "router" not in mesh.processes
    assert len(set(mesh.router_addresses)) == 2
    for router in mesh.router_addresses:  # the worker heartbeats to every router it was given
        async with grpc.aio.insecure_channel(router) as channel:
            reply = await router_admin_pb2_grpc.RouterAdminStub(channel).ListReplicas(
                router_admin_pb2.ListReplicasRequest(),
                metadata=(("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),),
                timeout=5,
            )
        assert [r.worker_id for r in reply.replicas] == ["edge-0"]
    for address in mesh.gateway_addresses:
        final = (await _answer(address)).final
        assert final.usage.completion_tokens > 0 and final.route.worker_id == "edge-0"
    described = mesh.describe()
    assert described["gateways"] == mesh.gateway_addresses and described["gateway"] == mesh.gateway_address


async def test_envoy_balances_over_both_replicas(mesh: Mesh) -> None:
    assert mesh.front_door is not None
    hosts = await mesh.front_door.envoy.hosts(GRPC_CLUSTER)
    assert hosts == dict.fromkeys(mesh.gateway_addresses, True)
    names = ["gateway", "gateway-1"]
    before = {n: await asyncio.to_thread(_gateway_requests, mesh, n) for n in names}
    for _ in range(8):
        assert (await _answer(mesh.front_door.address)).final.usage.completion_tokens > 0
    after = {n: await asyncio.to_thread(_gateway_requests, mesh, n) for n in names}
    served = {n: after[n] - before[n] for n in names}
    assert sum(served.values()) == 8 and all(v >= 1 for v in served.values()), served  # round robin
