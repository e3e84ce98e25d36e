"""The real mesh as processes (same launcher as `meshserve up`), started once for the e2e tests."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.controlplane.frontdoor import FrontDoor
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig
from tests.helpers import RedisServer

API_KEY = DEV_API_KEY


def session_db(server: RedisServer) -> str:
    """The session mesh's database on the session's redis-server."""
    return server.url.rsplit("/", 1)[0] + "/1"


def _sink(name: str, line: str) -> None:
    # Only warnings and errors reach the test output; full logs are noisy.
    if '"level": "error"' in line or '"level": "warning"' in line or "Traceback" in line:
        sys.stderr.write(f"{name} | {line}\n")


@pytest.fixture(scope="session")
async def mesh(redis_srv: RedisServer) -> AsyncIterator[Mesh]:
    # The split layout (`meshserve up --split-router`): these tests reach the router as a process of its
    # own (health, metrics, status); test_embedded_mesh.py and test_router_failover.py run the default.
    # It lives until the whole session ends, so it keeps database 1 of the session's redis-server to
    # itself: its batch runner would otherwise take the lines other tests put on database 0's work stream.
    config = MeshConfig(
        edge_workers=2, cloud_workers=1, redis_url=session_db(redis_srv), edge_max_prompt_tokens=64, embed_router=False
    )
    async with Mesh(config, sink=_sink) as running:
        yield running


@pytest.fixture(scope="session")
async def gateway(mesh: Mesh) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def auth(key: str = API_KEY) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def worker_stub(address: str) -> tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, worker_pb2_grpc.WorkerStub(channel)


@pytest.fixture(scope="session")
async def door(mesh: Mesh) -> AsyncIterator[FrontDoor]:
    """Envoy + the OpenAI adapter in front of the session mesh, started once for every module that uses it
    (a module that needs other adapter settings defines its own ``door``)."""
    async with FrontDoor([mesh.gateway_address], _sink) as running:
        yield running
