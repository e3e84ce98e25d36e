"""`meshserve up`'s launcher with the front door on: Envoy starts last and serves the OpenAI API."""

from __future__ import annotations

import openai
import pytest

from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig
from tests.e2e.conftest import _sink
from tests.helpers import RedisServer

pytestmark = pytest.mark.e2e


async def test_mesh_with_envoy_serves_openai_and_stops_cleanly(redis_srv: RedisServer) -> None:
    config = MeshConfig(edge_workers=1, cloud_workers=0, redis_url=redis_srv.url, envoy=True)
    async with Mesh(config, sink=_sink) as mesh:
        assert mesh.front_door is not None
        envoy = mesh.front_door.envoy.process.proc
        async with openai.AsyncOpenAI(base_url=mesh.http_base_url, api_key=DEV_API_KEY, max_retries=0) as client:
            reply = await client.completions.create(model="", prompt="Hello", max_tokens=4, temperature=0)
            assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 4
    assert envoy is not None and envoy.returncode is not None  # stopped with the mesh
    assert mesh.front_door is None
