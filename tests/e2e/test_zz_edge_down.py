"""The shared mesh with its edge tier gone: a short prompt is served by the cloud tier.

This module stops the edge workers of the session's shared mesh (tests/e2e/conftest.py), so it is
named to run after every other module that uses that mesh."""

from __future__ import annotations

import asyncio

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.local.mesh import Mesh
from tests.e2e.test_mesh import collect, greedy


async def test_zz_short_prompt_is_served_by_cloud_when_all_edge_workers_are_down(gateway, mesh: Mesh) -> None:
    await asyncio.gather(*(w.stop() for w in mesh.workers("edge")))
    _tokens, text, final = await collect(gateway, greedy("Hello there, how are", 8, policy=pb.CACHE_POLICY_BYPASS))
    assert final.route.tier == pb.TIER_CLOUD
    assert text
