"""`meshserve up --gateways 2 --edge-version int8=DIR`: two gateway replicas, each with its own embedded
router that the workers heartbeat to, both behind Envoy, which balances over them; the mesh stops
cleanly. One Redis, two builds of the real model: a rollout changed or rolled back through one
replica's router is in force on the other (shared through Redis), and requests through the other
gateway follow it."""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as admin_pb
from services.common.pb.meshserve.internal.v1 import router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.controlplane.xds import GRPC_CLUSTER
from services.local.mesh import Mesh, MeshConfig
from tests.e2e.conftest import auth
from tests.helpers import RedisServer

ADMIN = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)
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
    int8 = str(model_paths().root / "draft-int8")
    config = MeshConfig(
        edge_workers=1,
        cloud_workers=0,
        redis_url=redis_srv.url,
        gateways=2,
        envoy=True,
        edge_versions={"int8": int8},
    )
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
    for router in mesh.router_addresses:  # each worker heartbeats to every router it was given
        async with grpc.aio.insecure_channel(router) as channel:
            reply = await router_admin_pb2_grpc.RouterAdminStub(channel).ListReplicas(
                admin_pb.ListReplicasRequest(), metadata=ADMIN, timeout=5
            )
        assert sorted(r.worker_id for r in reply.replicas) == ["edge-0", "edge-version-int8"]
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


async def _rollout(router: str) -> admin_pb.ModelRollout:
    async with grpc.aio.insecure_channel(router) as channel:
        reply = await router_admin_pb2_grpc.RouterAdminStub(channel).ListRollouts(
            admin_pb.ListRolloutsRequest(model=DEFAULT_MODEL_ID), metadata=ADMIN, timeout=5
        )
    return reply.models[0]


async def _until(router: str, weights: dict[str, int], within_s: float = 5.0) -> admin_pb.ModelRollout:
    loop = asyncio.get_running_loop()
    began = loop.time()
    while True:
        status = await _rollout(router)
        if {w.version: w.weight for w in status.weights} == weights:
            return status
        assert loop.time() - began < within_s, f"{router} still has {status.weights}"
        await asyncio.sleep(0.05)


async def _worker(gateway: str) -> str:
    async with grpc.aio.insecure_channel(gateway) as channel:
        reply = await inference_pb2_grpc.InferenceStub(channel).Complete(REQUEST, metadata=auth(), timeout=60)
    return reply.final.route.worker_id


async def _set(router: str, **weights: int) -> None:
    req = admin_pb.SetRolloutRequest(
        model=DEFAULT_MODEL_ID, weights=[admin_pb.VersionWeight(version=v, weight=w) for v, w in weights.items()]
    )
    async with grpc.aio.insecure_channel(router) as channel:
        await router_admin_pb2_grpc.RouterAdminStub(channel).SetRollout(req, metadata=ADMIN, timeout=5)


async def test_a_rollout_through_one_replica_is_in_force_on_the_other(mesh: Mesh) -> None:
    first, second = mesh.router_addresses
    assert first != second
    before = await _rollout(second)
    assert {w.version: w.weight for w in before.weights} == {"prepared": 100}  # the models file's
    assert before.policy_store == "shared"
    await _set(first, prepared=0, int8=100)
    status = await _until(second, {"prepared": 0, "int8": 100})
    assert status.policy_epoch == (await _rollout(first)).policy_epoch
    # Through the other gateway (its own router): the int8 build's worker answers.
    assert {await _worker(mesh.gateway_addresses[1]) for _ in range(3)} == {"edge-version-int8"}
    await _set(second, prepared=90, int8=10)  # a canary of int8 on the prepared build
    await _until(first, {"prepared": 90, "int8": 10})
    async with grpc.aio.insecure_channel(second) as channel:
        await router_admin_pb2_grpc.RouterAdminStub(channel).Rollback(
            admin_pb.RollbackRequest(model=DEFAULT_MODEL_ID), metadata=ADMIN, timeout=5
        )
    await _until(first, {"prepared": 100, "int8": 0})
    assert {await _worker(mesh.gateway_addresses[0]) for _ in range(3)} == {"edge-0"}
