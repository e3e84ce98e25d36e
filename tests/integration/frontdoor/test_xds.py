"""The control plane adds and removes gateway replicas; Envoy follows over xDS without a restart."""

from __future__ import annotations

import aiohttp
import grpc
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.controlplane.frontdoor import FrontDoor
from services.controlplane.xds import GRPC_CLUSTER
from tests.integration.frontdoor.conftest import sink, start_named_gateway

pytestmark = pytest.mark.integration
CALLS = 8  # round robin over at most 2 replicas: 8 calls reach each of them


async def _answered_by(stub: inference_pb2_grpc.InferenceStub) -> set[str]:
    names = set()
    for _ in range(CALLS):
        reply = await stub.ListModels(pb.ListModelsRequest())
        names.add(reply.models[0].id)
    return names


async def _http_answered_by(base_url: str) -> set[str]:
    names = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(CALLS):
            async with session.get(f"{base_url}/models") as reply:
                assert reply.status == 200
                names.add((await reply.json())["data"][0]["id"])
    return names


async def test_adding_and_removing_a_gateway_reaches_envoy_without_restart() -> None:
    a, b = await start_named_gateway("gateway-a"), await start_named_gateway("gateway-b")
    addr_a, addr_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    try:
        async with FrontDoor([addr_a], sink) as door, grpc.aio.insecure_channel(door.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            envoy_pid = door.envoy.process.proc.pid  # type: ignore[union-attr]
            assert await _answered_by(stub) == {"gateway-a"}

            await door.set_gateways([addr_a, addr_b])  # returns once Envoy's admin shows both healthy
            assert await door.envoy.hosts(GRPC_CLUSTER) == {addr_a: True, addr_b: True}
            assert await _answered_by(stub) == {"gateway-a", "gateway-b"}
            assert await _http_answered_by(door.base_url) == {"gateway-a", "gateway-b"}

            await door.set_gateways([addr_b])
            assert set(await door.envoy.hosts(GRPC_CLUSTER)) == {addr_b}
            assert await _answered_by(stub) == {"gateway-b"}
            assert await _http_answered_by(door.base_url) == {"gateway-b"}

            assert door.envoy.process.proc.pid == envoy_pid  # type: ignore[union-attr]
            assert door.envoy.process.proc.returncode is None  # type: ignore[union-attr]
    finally:
        await a.stop()
        await b.stop()


async def test_a_dead_gateway_leaves_rotation_by_health_check() -> None:
    a, b = await start_named_gateway("gateway-a"), await start_named_gateway("gateway-b")
    addr_a, addr_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    try:
        async with FrontDoor([addr_a, addr_b], sink) as door, grpc.aio.insecure_channel(door.address) as channel:
            await b.stop()  # no EDS update: only Envoy's active health check can notice
            await door.envoy.wait_until(lambda hosts: hosts.get(addr_b) is False, GRPC_CLUSTER, 15.0)
            assert await _answered_by(inference_pb2_grpc.InferenceStub(channel)) == {"gateway-a"}
    finally:
        await a.stop()
        await b.stop()


async def test_envoys_own_reply_to_a_grpc_caller_is_a_plain_grpc_status() -> None:
    """With no healthy gateway Envoy answers itself: gRPC callers get UNAVAILABLE with Envoy's text
    (HTTP callers get OpenAI error JSON, see test_openai.py; that formatting must not leak into gRPC)."""
    a = await start_named_gateway("gateway-a")
    addr_a = f"127.0.0.1:{a.port}"
    try:
        async with FrontDoor([addr_a], sink) as door, grpc.aio.insecure_channel(door.address) as channel:
            await a.stop()
            await door.envoy.wait_until(lambda hosts: hosts.get(addr_a) is False, GRPC_CLUSTER, 15.0)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await inference_pb2_grpc.InferenceStub(channel).ListModels(pb.ListModelsRequest())
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            details = info.value.details() or ""
            assert details and not details.startswith("{")
    finally:
        await a.stop()
