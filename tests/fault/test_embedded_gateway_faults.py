"""The gateway dying in `meshserve up`'s default layout, where it carries the router.

``kill -9`` of the gateway mid-stream takes the router with it: every open stream ends promptly with
UNAVAILABLE (frames numbered without a gap, no hang); the workers, whose GenerateMux calls broke,
stop the orphaned generations by themselves (no router is left to cancel them); calls while it is
down fail fast with UNAVAILABLE. Restarted on its old ports, the gateway's router knows no worker at
first: the workers register again by heartbeat, and the same client channel then gets the undisturbed
output. The full suite also stops it gracefully (SIGTERM): in-flight streams finish whole first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.mesh import Mesh, MeshConfig
from tests.fault.conftest import (
    FULL,
    MAX_TOKENS,
    PROMPTS,
    ROUTER_ENV,
    STREAMS,
    _sink,
    active_sequences,
    assert_equal_to_reference,
    auth,
    finish,
    greedy,
    reference,
    restart,
    run_load,
)
from tests.helpers import RedisServer

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
async def embedded_mesh(fault_redis: RedisServer) -> AsyncIterator[Mesh]:
    config = MeshConfig(edge_workers=2, cloud_workers=0, redis_url=fault_redis.url, extra_env=ROUTER_ENV)
    assert config.embed_router  # the default layout
    async with Mesh(config, sink=_sink) as running:
        yield running


async def _wait_idle(mesh: Mesh, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while await active_sequences(mesh):
        assert time.monotonic() < deadline, f"workers still generating {bound_s:.0f} s after the gateway died"
        await asyncio.sleep(0.1)  # polling worker Stats; there is no event for "idle"


@pytest.mark.parametrize("how", ["kill_9", *(["sigterm"] if FULL else [])])
async def test_a_gateway_with_its_router_restarted_under_load_serves_again(embedded_mesh: Mesh, how: str) -> None:
    assert "router" not in embedded_mesh.processes
    prompts = PROMPTS[:STREAMS]
    max_tokens = MAX_TOKENS if how == "kill_9" else 24  # a graceful stop drains within its 10 s grace
    async with grpc.aio.insecure_channel(embedded_mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        expected = await reference(stub, prompts, max_tokens)
        streams, done = await run_load(stub, prompts, max_tokens, started_after=2)
        await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 60)
        gateway = embedded_mesh.processes["gateway"]
        if how == "kill_9":
            await gateway.kill()
            await finish(done)
            for stream in streams:  # each ends at once, with what it got so far numbered without gap
                assert stream.error == grpc.StatusCode.UNAVAILABLE, (stream.error, stream.details, stream.final)
                assert stream.sequences == list(range(len(stream.sequences)))
            await _wait_idle(embedded_mesh, 30)  # the workers stopped the generations of the broken calls
        else:
            await gateway.stop()  # SIGTERM: NOT_SERVING, drain in-flight streams, exit
            await finish(done)
            assert_equal_to_reference(streams, expected)

        with pytest.raises(grpc.aio.AioRpcError) as down:  # while it is down: fail fast, no hang
            await stub.Complete(greedy(PROMPTS[0], 2), metadata=auth(), timeout=10)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE

        # Same public and internal ports (its environment): the workers' heartbeats find the new router.
        await restart(embedded_mesh, "gateway", "MESHSERVE_GATEWAY_PORT")
        streams, done = await run_load(stub, prompts, max_tokens)  # the same channel reconnects
        await finish(done)
        assert_equal_to_reference(streams, expected)
