"""Self-registration with real processes: `meshserve up`'s launcher, three edge workers that register
with the router by heartbeat, the router's replica view read over RouterAdmin.ListReplicas.

A worker serving a held chat shows up in the router's view with that chat's load report (held chat,
KV tokens, hot prefix blocks the policy counts); a worker stopped with SIGTERM says goodbye and is
gone at once; one killed with SIGKILL is gone after the heartbeat TTL; traffic goes on.
"""

from __future__ import annotations

import asyncio
import sys
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

ADMIN_META = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)


def _sink(name: str, line: str) -> None:
    if '"level": "error"' in line or "Traceback" in line:
        sys.stderr.write(f"{name} | {line}\n")


@pytest.fixture(scope="module")
async def mesh(redis_srv: RedisServer) -> AsyncIterator[Mesh]:
    config = MeshConfig(edge_workers=3, cloud_workers=0, redis_url=redis_srv.url)
    async with Mesh(config, sink=_sink) as running:
        yield running


async def replicas(mesh: Mesh) -> dict[str, router_admin_pb2.ReplicaStatus]:
    async with grpc.aio.insecure_channel(mesh.router_address) as channel:
        reply = await router_admin_pb2_grpc.RouterAdminStub(channel).ListReplicas(
            router_admin_pb2.ListReplicasRequest(), metadata=ADMIN_META, timeout=5
        )
    return {r.worker_id: r for r in reply.replicas}


async def until(mesh: Mesh, condition: object, timeout_s: float = 20.0) -> dict[str, router_admin_pb2.ReplicaStatus]:
    """The router's view once ``condition(view)`` holds (polled every 0.2 s, bounded)."""
    view: dict[str, router_admin_pb2.ReplicaStatus] = {}
    for _ in range(int(timeout_s / 0.2)):
        view = await replicas(mesh)
        if condition(view):  # type: ignore[operator]
            return view
        await asyncio.sleep(0.2)  # polling router state that heartbeats change
    raise AssertionError(f"the router's replica view never reached the expected state: {view}")


async def complete(gateway: inference_pb2_grpc.InferenceStub, prompt: str) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(max_tokens=4),
        routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
    )
    return await gateway.Complete(request, metadata=auth(), timeout=60)


async def test_workers_register_report_load_and_leave(mesh: Mesh) -> None:
    view = await until(mesh, lambda v: {k for k, r in v.items() if r.healthy} == {"edge-0", "edge-1", "edge-2"})
    assert all(r.self_registered for r in view.values())  # `meshserve up` gives the router no static list

    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        gateway = inference_pb2_grpc.InferenceStub(channel)
        outbox: asyncio.Queue[pb.ChatRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.ChatRequest]:
            while (item := await outbox.get()) is not None:
                yield item

        call = gateway.Chat(requests(), metadata=auth())
        await outbox.put(
            pb.ChatRequest(
                turn=pb.ChatTurn(
                    messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
                    sampling=pb.SamplingParams(max_tokens=8),
                )
            )
        )
        async for frame in call:
            if frame.HasField("final"):
                holder = frame.final.route.worker_id
                break
        # The chat's KV is held between turns: the holder's load report says so, and the router
        # counts the held prefix's blocks when it scores that replica.
        view = await until(mesh, lambda v: v[holder].held_sequences == 1 and v[holder].hot_prefix_blocks > 0)
        assert view[holder].kv_tokens >= view[holder].hot_prefix_blocks * 16
        await outbox.put(None)

        others = sorted(set(view) - {holder})
        await mesh.processes[others[0]].stop()  # SIGTERM: says goodbye before draining
        assert others[0] not in await replicas(mesh)

        await mesh.processes[others[1]].kill()  # SIGKILL: no goodbye; forgotten after the heartbeat TTL
        view = await until(mesh, lambda v: others[1] not in v)
        assert set(view) == {holder} and view[holder].healthy
        answer = await complete(gateway, "Name a colour.")
        assert answer.final.route.worker_id == holder
