"""Router resilience: resume after a worker dies or stalls, collapsing, self-registration (fake workers)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common import errors
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.router.balancer.registry import Registry, WorkerReport
from services.router.balancer.tiers import TierName
from tests.integration.router.fake_worker import start_fake
from tests.integration.router.harness import LONG_PROMPT, META, TOKEN, Mesh, final, generate, request, tokens

pytestmark = [
    pytest.mark.integration,
]


async def test_worker_dying_mid_stream_is_resumed_elsewhere_without_duplicate_or_gap(mesh: Mesh) -> None:
    bypass = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
    undisturbed = tokens(await generate(mesh, request("Resume me", 12, routing=bypass)))
    for e in mesh.edges:
        e.die_after_tokens = 5
    frames = await generate(mesh, request("Resume me", 12, routing=bypass))
    fin = final(frames)  # also checks the sequence numbers
    assert tokens(frames) == undisturbed
    assert fin.route.reason == "failover" and fin.usage.completion_tokens == 12
    # Both edges die after 5 tokens each: edge -> edge (resumed at 5) -> cloud (resumed at 10).
    resumed = sorted((list(s.resume_token_ids) for w in mesh.all() for s in w.starts if s.resume_token_ids), key=len)
    assert resumed == [undisturbed[:5], undisturbed[:10]]


async def test_failover_budget_is_bounded(mesh: Mesh) -> None:
    for w in mesh.all():
        w.die_after_tokens = 2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(
            mesh, request("Resume me again", 12, routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS))
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sum(1 for w in mesh.all() for s in w.starts if s.resume_token_ids) == 2  # failovers_after_first_token


async def test_collapsed_identical_requests_reach_one_worker(mesh: Mesh) -> None:
    for w in mesh.all():
        w.token_delay_s = 0.01
    results = await asyncio.gather(*(generate(mesh, request("Same question", 8)) for _ in range(5)))
    assert sum(len(w.starts) for w in mesh.all()) == 1
    assert all(tokens(r) == tokens(results[0]) for r in results)
    assert sorted(final(r).route.reason for r in results).count("collapsed") >= 1


async def test_client_cancel_of_a_collapsed_request_stops_the_worker_when_all_left(mesh: Mesh) -> None:
    for w in mesh.all():
        w.token_delay_s = 0.05
    calls = [mesh.stub.Generate(request("Cancel us", 200), metadata=META) for _ in range(2)]
    for call in calls:
        await call.read()  # first token of each
    calls[0].cancel()
    worker = next(w for w in mesh.all() if w.starts)
    assert not worker.cancelled.is_set()
    calls[1].cancel()
    await asyncio.wait_for(worker.cancelled.wait(), 5)


async def test_stalled_worker_is_ejected_and_the_stream_resumed(mesh: Mesh) -> None:
    bypass = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
    undisturbed = tokens(await generate(mesh, request("Stall here", 8, routing=bypass)))
    for e in mesh.edges:
        e.stall_after_tokens = 3
    frames = await generate(mesh, request("Stall here", 8, routing=bypass))
    assert tokens(frames) == undisturbed and final(frames).route.reason == "failover"
    assert any(r.ejections for r in mesh.router.registry.replicas if r.tier.value == "edge")


async def test_a_worker_queueing_longer_than_the_stall_timeout_is_not_a_stall(mesh: Mesh) -> None:
    """Queued keepalives restart the stall timer: no ejection, no failover, the stream is whole."""
    bypass = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
    undisturbed = tokens(await generate(mesh, request("Queue here", 8, routing=bypass)))
    for e in mesh.edges:
        e.queued_for_s = 2.5  # the harness's stall timeout is 1 s
    frames = await generate(mesh, request("Queue here", 8, routing=bypass))
    assert tokens(frames) == undisturbed and final(frames).route.reason != "failover"
    assert [f.sequence for f in frames] == list(range(len(frames)))
    assert not any(r.ejections for r in mesh.router.registry.replicas)


async def test_self_registered_worker_joins_by_heartbeat_and_leaves(mesh: Mesh) -> None:
    from services.common.pb.meshserve.internal.v1 import registry_pb2, registry_pb2_grpc, worker_pb2

    extra = await start_fake("cloud-9", pb.TIER_CLOUD, TOKEN)
    registry = registry_pb2_grpc.WorkerRegistryStub(mesh.channel)
    beat = registry_pb2.WorkerHeartbeat(
        address=extra.address,
        tier=pb.TIER_CLOUD,
        stats=worker_pb2.WorkerStats(worker_id="cloud-9", stream_port=extra.stream_port),  # as a worker's heartbeat
    )
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry.Heartbeat(beat)  # no internal credential
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        reply = await registry.Heartbeat(beat, metadata=META)
        assert reply.ttl_ms > 0
        assert any(r.address == extra.address and r.healthy for r in mesh.router.registry.replicas)
        mesh.cloud.fail_next = errors.Unavailable("fake failure")  # the static cloud replica fails: use the new one
        fin = final(
            await generate(mesh, request(LONG_PROMPT, routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)))
        )
        assert fin.route.tier == pb.TIER_CLOUD and fin.route.worker_id == "cloud-9"
        beat.leaving = True
        await registry.Heartbeat(beat, metadata=META)
        assert all(r.address != extra.address for r in mesh.router.registry.replicas)
    finally:
        assert extra.server is not None
        await extra.server.stop()


async def test_registered_worker_without_heartbeats_expires(mesh: Mesh) -> None:
    registry = mesh.router.registry
    extra = await start_fake("edge-9", pb.TIER_EDGE, TOKEN)
    try:
        registry.heartbeat_ttl_s = 0.01
        await registry.heartbeat(extra.address, TierName.EDGE, WorkerReport(worker_id="edge-9"))
        assert any(r.address == extra.address for r in registry.replicas)
        await asyncio.wait_for(_until_gone(registry, extra.address), 5)
    finally:
        assert extra.server is not None
        await extra.server.stop()


async def _until_gone(registry: Registry, address: str) -> None:
    while any(r.address == address for r in registry.replicas):
        await registry.probe_all()


async def test_replicas_out_of_kv_room_get_no_new_turns_and_a_full_tier_spills(mesh: Mesh) -> None:
    registry = mesh.router.registry
    bypass = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
    full, spare = mesh.edges
    full.kv_used_bytes, full.kv_budget_bytes = 99, 100  # at or above the 0.95 watermark
    spare.kv_used_bytes, spare.kv_budget_bytes = 10, 100
    await registry.probe_all()  # pull the load reports now
    served = {final(await generate(mesh, request(f"Short {i}", 2, routing=bypass))).route.worker_id for i in range(4)}
    assert served == {"edge-1"}

    spare.kv_used_bytes = 100  # the whole edge tier is out of KV room: short prompts spill to the cloud
    await registry.probe_all()
    fin = final(await generate(mesh, request("Short again", 2, routing=bypass)))
    assert (fin.route.tier, fin.route.reason) == (pb.TIER_CLOUD, "spill_saturated")

    full.kv_used_bytes = spare.kv_used_bytes = 0  # KV freed: the edge tier takes turns again
    await registry.probe_all()
    fin = final(await generate(mesh, request("Short at last", 2, routing=bypass)))
    assert fin.route.tier == pb.TIER_EDGE


async def test_a_heartbeat_beyond_max_replicas_is_refused_until_one_leaves(mesh: Mesh) -> None:
    from services.common.pb.meshserve.internal.v1 import registry_pb2, registry_pb2_grpc

    registry = mesh.router.registry
    registry.max_replicas = len(registry.replicas)  # the static workers fill it
    stub = registry_pb2_grpc.WorkerRegistryStub(mesh.channel)
    fakes = [f"127.0.0.1:{port}" for port in (1, 2, 3)]  # addresses a misbehaving fleet announces
    try:
        for address in fakes:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Heartbeat(registry_pb2.WorkerHeartbeat(address=address, tier=pb.TIER_EDGE), metadata=META)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "MESHSERVE_ROUTER_MAX_REPLICAS" in (err.value.details() or "")
            assert dict(err.value.trailing_metadata() or ()).get("retry-after-ms")
        assert all(r.address not in fakes for r in registry.replicas)
        registry.max_replicas += 1  # room for one: it joins, and leaving frees its place for the next
        await stub.Heartbeat(registry_pb2.WorkerHeartbeat(address=fakes[0], tier=pb.TIER_EDGE), metadata=META)
        assert any(r.address == fakes[0] for r in registry.replicas)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Heartbeat(registry_pb2.WorkerHeartbeat(address=fakes[1], tier=pb.TIER_EDGE), metadata=META)
        await stub.Heartbeat(
            registry_pb2.WorkerHeartbeat(address=fakes[0], tier=pb.TIER_EDGE, leaving=True), metadata=META
        )
        await stub.Heartbeat(registry_pb2.WorkerHeartbeat(address=fakes[1], tier=pb.TIER_EDGE), metadata=META)
        assert [r.address for r in registry.replicas if r.address in fakes] == [fakes[1]]
    finally:
        registry.max_replicas = 1024
