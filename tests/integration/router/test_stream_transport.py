"""The router's worker streams over the stream transport (services/router/balancer/stream_transport.py): a
real router, fake workers serving the worker runtime's own listener (services/worker/mux_tcp.py)
over real TCP. One connection per worker carries every stream; cancel and a worker's death behave
as before; a worker whose stream port cannot be used is a failed worker (ejected, the request
retried elsewhere, nothing lost)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.config import load_settings
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import MAX_MESSAGE_BYTES
from services.common.tokenizer import Tokenizer
from services.router.config import RouterSettings
from services.router.server import start_router
from services.worker.mux import MuxCalls
from services.worker.mux_tcp import StreamMuxServer
from tests.helpers import free_port
from tests.integration.router.fake_worker import FakeWorker, start_fake
from tests.integration.router.harness import (
    META,
    TOKEN,
    Mesh,
    final,
    generate,
    kill_mid_stream,
    open_mesh,
    request,
    wait_serving,
)

EDGE = pb.RoutingOptions(tier=pb.TIER_EDGE, cache_policy=pb.CACHE_POLICY_BYPASS)


@pytest.fixture
async def tcp_mesh(tokenizer: Tokenizer, redis_url: str) -> AsyncIterator[Mesh]:
    # 6 slots per edge: 12 concurrent requests fit on the edges (the default 4 spills to the cloud)
    async with open_mesh(tokenizer, redis_url, replica_slots=6) as mesh:
        yield mesh


def _connections(mesh: Mesh) -> list[int]:
    return [e.stream.connections if e.stream is not None else 0 for e in mesh.edges]


async def test_concurrent_requests_share_one_connection_per_worker(tcp_mesh: Mesh) -> None:
    prompts = [f"Question number {i}?" for i in range(12)]
    results = await asyncio.gather(*(generate(tcp_mesh, request(p, max_tokens=5, routing=EDGE)) for p in prompts))
    assert all(final(frames).usage.completion_tokens == 5 for frames in results)
    assert sum(len(e.starts) for e in tcp_mesh.edges) == 12
    assert _connections(tcp_mesh) == [1, 1]  # every stream rode the worker's one connection


async def test_a_retired_connection_ends_and_the_next_request_reconnects(tcp_mesh: Mesh) -> None:
    assert final(await generate(tcp_mesh, request("first", routing=EDGE))).usage.completion_tokens == 4
    for replica in tcp_mesh.router.registry.replicas:
        tcp_mesh.router.transport.retire(replica.address)  # ends the idle connections
    await asyncio.sleep(0.1)
    assert final(await generate(tcp_mesh, request("second", routing=EDGE))).usage.completion_tokens == 4
    assert sum(_connections(tcp_mesh)) >= 2  # a new connection was opened


async def test_cancelling_a_request_cancels_its_stream_on_the_worker(tcp_mesh: Mesh) -> None:
    for edge in tcp_mesh.edges:
        edge.token_delay_s = 0.05
    call = tcp_mesh.stub.Generate(request("cancel me", max_tokens=200, routing=EDGE), metadata=META)
    async for frame in call:
        if frame.token_ids:
            break
    call.cancel()
    serving = next(e for e in tcp_mesh.edges if e.starts)
    await asyncio.wait_for(serving.cancelled.wait(), 5)  # the worker's turn ended, not ran on


async def test_worker_death_mid_stream_resumes_elsewhere(tcp_mesh: Mesh) -> None:
    async def kill(worker: FakeWorker) -> None:
        await worker.crash()  # its connection ends mid-stream, as when the process dies

    frames, serving = await kill_mid_stream(tcp_mesh, kill, EDGE)
    tokens = [t for f in frames for t in f.token_ids]
    assert len(tokens) == 30
    assert final(frames).route.worker_id != serving.worker_id  # finished by the other edge worker


async def _served_elsewhere(mesh: Mesh, prompt: str) -> None:
    """Four requests preferring the edges, whose stream ports cannot be used: each is answered in
    full by the cloud worker, and the edges are ejected (a failed worker), none ever started a turn."""
    await mesh.router.registry.probe_all()
    for i in range(4):
        frames = await generate(mesh, request(f"{prompt} {i}", routing=EDGE))
        assert final(frames).usage.completion_tokens == 4  # not one request lost to the refusals
        assert final(frames).route.worker_id == "cloud-0"
    assert sum(len(e.starts) for e in mesh.edges) == 0
    assert all(r.failures >= 1 for r in mesh.router.registry.replicas if r.tier.value == "edge")  # ejected


async def test_a_port_that_does_not_serve_it_is_a_failed_worker(tcp_mesh: Mesh) -> None:
    for edge in tcp_mesh.edges:
        edge.stream_port = free_port()  # announced, but nothing listens there
    await _served_elsewhere(tcp_mesh, "hello")


async def test_a_worker_refusing_the_routers_credential_is_a_failed_worker(tcp_mesh: Mesh) -> None:
    others = []
    for edge in tcp_mesh.edges:
        other = StreamMuxServer(edge.Generate, MuxCalls(), "another mesh's token", MAX_MESSAGE_BYTES)
        await other.start("127.0.0.1", 0)
        edge.stream_port = other.port
        others.append(other)
    try:
        await _served_elsewhere(tcp_mesh, "hi")
        assert all(other.connections >= 1 for other in others)  # each was asked, and refused
    finally:
        for other in others:
            other.close()
            await other.finish()


async def test_a_worker_without_a_stream_port_is_a_failed_worker(tokenizer: Tokenizer, redis_url: str) -> None:
    old = await start_fake("old-edge", pb.TIER_EDGE, TOKEN, stream=False)  # announces no stream port
    spare = await start_fake("spare-cloud", pb.TIER_CLOUD, TOKEN)
    settings = load_settings(
        RouterSettings,
        edge_workers=old.address,
        cloud_workers=spare.address,
        redis_url=redis_url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        health_interval_s=0.2,
        eject_base_s=0.001,
        readmit_s=0,
    )
    server, router = await start_router(settings, tokenizer=tokenizer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        await asyncio.wait_for(wait_serving(channel), 10)
        stub = inference_pb2_grpc.InferenceStub(channel)
        for prompt in ("hello", "hello again"):
            frames = [f async for f in stub.Generate(request(prompt, routing=EDGE), metadata=META)]
            assert final(frames).usage.completion_tokens == 4  # the edge failed; the request did not
            assert final(frames).route.worker_id == "spare-cloud"
            await router.registry.probe_all()  # the edge is back in the routing set: tried again
        assert old.calls == 0 and not old.starts
    finally:
        await channel.close()
        await server.stop()
        for fake in (old, spare):
            assert fake.server is not None
            await fake.server.stop()
