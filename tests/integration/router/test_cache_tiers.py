"""The response cache keeps one answer per tier: edge and cloud run different weights under one model id.

Real router on port 0, real Redis, fake workers whose deterministic tokens depend on their weights
(the cloud fake runs other weights than the edge fakes, as the fp32 teacher vs the INT4 student).
"""

from __future__ import annotations

import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from tests.integration.router.harness import Mesh, final, generate, request, tokens

pytestmark = [
    pytest.mark.integration,
]

EDGE = pb.RoutingOptions(tier=pb.TIER_EDGE)
CLOUD = pb.RoutingOptions(tier=pb.TIER_CLOUD)


def starts(mesh: Mesh) -> tuple[int, int]:
    """(turns started on edge workers, on the cloud worker)."""
    return sum(len(e.starts) for e in mesh.edges), len(mesh.cloud.starts)


async def set_serving(mesh: Mesh, edge: bool, cloud: bool) -> None:
    for worker, up in [*((e, edge) for e in mesh.edges), (mesh.cloud, cloud)]:
        assert worker.server is not None
        await worker.server.set_serving(up)
    await mesh.router.registry.probe_all()


async def test_a_cloud_hint_never_gets_the_edge_models_cached_answer(mesh: Mesh) -> None:
    mesh.cloud.weights = 1
    prompt = "What is the capital of France?"
    edge = await generate(mesh, request(prompt, 6, routing=EDGE))
    fin = final(edge)
    assert (fin.route.tier, fin.route.cache_hit) == (pb.TIER_EDGE, False)
    assert starts(mesh) == (1, 0)

    # The same request asking for the cloud tier runs on the cloud worker: not the edge's entry.
    cloud = await generate(mesh, request(prompt, 6, routing=CLOUD))
    fin = final(cloud)
    assert (fin.route.tier, fin.route.cache_hit, fin.route.worker_id, fin.route.reason) == (
        pb.TIER_CLOUD,
        False,
        "cloud-0",
        "hint",
    )
    assert starts(mesh) == (1, 1)
    assert tokens(cloud) != tokens(edge)

    # Now each tier has its entry, and a hit says whose weights produced it.
    again = await generate(mesh, request(prompt, 6, routing=CLOUD))
    fin = final(again)
    assert (fin.route.tier, fin.route.cache_hit, fin.route.reason, fin.route.worker_id) == (
        pb.TIER_CLOUD,
        True,
        "cache_hit",
        "",
    )
    assert tokens(again) == tokens(cloud) and fin.usage == final(cloud).usage
    hit = await generate(mesh, request(prompt, 6, routing=EDGE))
    assert (final(hit).route.tier, final(hit).route.cache_hit) == (pb.TIER_EDGE, True)
    assert tokens(hit) == tokens(edge)
    # No hint: the routing decision (a short prompt -> edge) picks the entry.
    auto = await generate(mesh, request(prompt, 6))
    assert (final(auto).route.tier, final(auto).route.cache_hit) == (pb.TIER_EDGE, True)
    assert tokens(auto) == tokens(edge)
    assert starts(mesh) == (1, 1)


async def test_a_fallback_answer_is_stored_under_the_tier_that_served_it(mesh: Mesh) -> None:
    mesh.cloud.weights = 1
    prompt = "Name three rivers."
    await set_serving(mesh, edge=True, cloud=False)
    fallback = await generate(mesh, request(prompt, 5, routing=CLOUD))
    fin = final(fallback)
    assert (fin.route.tier, fin.route.reason, fin.route.cache_hit) == (pb.TIER_EDGE, "fallback", False)
    assert starts(mesh) == (1, 0)
    # While the cloud is down a cloud hint falls back to the edge: its cached answer serves, labelled edge.
    while_down = await generate(mesh, request(prompt, 5, routing=CLOUD))
    assert (final(while_down).route.tier, final(while_down).route.cache_hit) == (pb.TIER_EDGE, True)

    await set_serving(mesh, edge=True, cloud=True)
    cloud = await generate(mesh, request(prompt, 5, routing=CLOUD))
    fin = final(cloud)
    assert (fin.route.tier, fin.route.cache_hit, fin.route.worker_id) == (pb.TIER_CLOUD, False, "cloud-0")
    assert tokens(cloud) != tokens(fallback)
    edge = await generate(mesh, request(prompt, 5, routing=EDGE))
    assert (final(edge).route.tier, final(edge).route.cache_hit) == (pb.TIER_EDGE, True)
    assert tokens(edge) == tokens(fallback)
    assert starts(mesh) == (1, 1)


async def test_cached_answers_still_serve_while_every_worker_is_down(mesh: Mesh) -> None:
    mesh.cloud.weights = 1
    prompt = "Why is the sky blue?"
    edge = tokens(await generate(mesh, request(prompt, 4)))
    cloud = tokens(await generate(mesh, request(prompt, 4, routing=CLOUD)))
    await set_serving(mesh, edge=False, cloud=False)
    cases = [(None, pb.TIER_EDGE, edge), (EDGE, pb.TIER_EDGE, edge), (CLOUD, pb.TIER_CLOUD, cloud)]
    for routing, tier, expected in cases:
        frames = await generate(mesh, request(prompt, 4, routing=routing))
        assert (final(frames).route.tier, final(frames).route.cache_hit) == (tier, True)
        assert tokens(frames) == expected
    assert starts(mesh) == (1, 1)


async def test_an_answer_resumed_on_the_other_tier_is_not_cached(mesh: Mesh) -> None:
    """Edge tokens continued by the cloud model are neither tier's answer."""
    mesh.cloud.weights = 1
    prompt = "Count to twelve."
    for e in mesh.edges:
        e.die_after_tokens = 3  # edge -> edge (resumed at 3) -> cloud (resumed at 6)
    mixed = await generate(mesh, request(prompt, 12))
    fin = final(mixed)
    assert (fin.route.tier, fin.route.reason, fin.usage.completion_tokens) == (pb.TIER_CLOUD, "failover", 12)
    cloud = await generate(mesh, request(prompt, 12, routing=CLOUD))
    fin = final(cloud)
    assert (fin.route.tier, fin.route.cache_hit, fin.route.worker_id) == (pb.TIER_CLOUD, False, "cloud-0")
    assert tokens(cloud) != tokens(mixed) and tokens(cloud)[6:] == tokens(mixed)[6:]
    assert final(await generate(mesh, request(prompt, 12, routing=CLOUD))).route.cache_hit
