"""The gateway dying in `meshserve up`'s default layout, where it carries the router.

``kill -9`` of the gateway mid-stream takes the router with it: every open stream ends promptly with
UNAVAILABLE (frames numbered without a gap, no hang); the workers, whose stream connections broke,
stop the orphaned generations by themselves (no router is left to cancel them); calls while it is
down fail fast with UNAVAILABLE. Restarted on its old ports, the gateway's router knows no worker at
first: the workers register again by heartbeat, and the same client channel then gets the undisturbed
output. The full suite also stops it gracefully (SIGTERM): in-flight streams finish whole first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.local.mesh import Mesh, MeshConfig
from tests.fault.conftest import FULL, ROUTER_ENV, _sink, gateway_restart_under_load
from tests.helpers import RedisServer

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
async def embedded_mesh(fault_redis: RedisServer) -> AsyncIterator[Mesh]:
    config = MeshConfig(edge_workers=2, cloud_workers=0, redis_url=fault_redis.url, extra_env=ROUTER_ENV)
    assert config.embed_router  # the default layout
    async with Mesh(config, sink=_sink) as running:
        yield running


@pytest.mark.parametrize("how", ["kill_9", *(["sigterm"] if FULL else [])])
async def test_a_gateway_with_its_router_restarted_under_load_serves_again(embedded_mesh: Mesh, how: str) -> None:
    assert "router" not in embedded_mesh.processes
    # kill_9: no router is left to cancel the orphaned generations; the workers stop them when their
    # stream connections break. The restarted gateway serves once the workers' heartbeats have found it.
    await gateway_restart_under_load(embedded_mesh, how)
