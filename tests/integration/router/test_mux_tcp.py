"""The router's worker streams over the stream transport (services/router/mux_tcp.py): a real router,
fake workers serving the worker runtime's own listener (services/worker/mux_tcp.py) over
real TCP, and the fall back to gRPC's GenerateMux where a worker cannot be reached that way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.serving import MAX_MESSAGE_BYTES
from services.common.tokenizer import Tokenizer
from services.worker.mux import MuxCalls
from services.worker.mux_tcp import StreamMuxServer
from tests.helpers import free_port
from tests.integration.router.fake_worker import FakeWorker
from tests.integration.router.harness import META, Mesh, final, generate, kill_mid_stream, open_mesh, request

EDGE = pb.RoutingOptions(tier=pb.TIER_EDGE, cache_policy=pb.CACHE_POLICY_BYPASS)


@pytest.fixture
async def tcp_mesh(tokenizer: Tokenizer, redis_url: str) -> AsyncIterator[Mesh]:
    # 6 slots per edge: 12 concurrent requests fit on the edges (the default 4 spills to the cloud)
    async with open_mesh(tokenizer, redis_url, edge_stream=True, replica_slots=6) as mesh:
        yield mesh


def _connections(mesh: Mesh) -> list[int]:
    return [e.stream.connections if e.stream is not None else 0 for e in mesh.edges]


async def test_concurrent_requests_share_one_connection_per_worker(tcp_mesh: Mesh) -> None:
    prompts = [f"Question number {i}?" for i in range(12)]
    results = await asyncio.gather(*(generate(tcp_mesh, request(p, max_tokens=5, routing=EDGE)) for p in prompts))
    assert all(final(frames).usage.completion_tokens == 5 for frames in results)
    assert sum(len(e.starts) for e in tcp_mesh.edges) == 12
    assert _connections(tcp_mesh) == [1, 1]  # every stream rode the worker's one connection
    assert [e.mux_calls for e in tcp_mesh.edges] == [0, 0]  # and none a gRPC call


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
        assert worker.server is not None and worker.stream is not None
        await worker.server.server.stop(0)
        worker.stream.close(0.0)
        await worker.stream.finish()  # its connection ends mid-stream, as when the process dies

    frames, serving = await kill_mid_stream(tcp_mesh, kill, EDGE)
    tokens = [t for f in frames for t in f.token_ids]
    assert len(tokens) == 30
    assert final(frames).route.worker_id != serving.worker_id  # finished by the other edge worker


async def test_a_port_that_does_not_serve_it_falls_back_to_grpc(tcp_mesh: Mesh) -> None:
    for edge in tcp_mesh.edges:
        edge.stream_port = free_port()  # announced, but nothing listens there
    await tcp_mesh.router.registry.probe_all()
    for i in range(4):
        assert final(await generate(tcp_mesh, request(f"hello {i}", routing=EDGE))).usage.completion_tokens == 4
    assert sum(len(e.starts) for e in tcp_mesh.edges) == 4  # not one try lost to the refusal
    assert [e.mux_calls for e in tcp_mesh.edges if e.starts] == [1] * len([e for e in tcp_mesh.edges if e.starts])


async def test_a_worker_refusing_the_routers_credential_is_served_over_grpc(tcp_mesh: Mesh) -> None:
    others = []
    for edge in tcp_mesh.edges:
        other = StreamMuxServer(edge.Generate, MuxCalls(), "another mesh's token", MAX_MESSAGE_BYTES)  # type: ignore[arg-type]
        await other.start("127.0.0.1", 0)
        edge.stream_port = other.port
        others.append(other)
    await tcp_mesh.router.registry.probe_all()
    try:
        for i in range(4):
            assert final(await generate(tcp_mesh, request(f"hi {i}", routing=EDGE))).usage.completion_tokens == 4
        used = [i for i, e in enumerate(tcp_mesh.edges) if e.starts]
        assert [others[i].connections for i in used] == [1] * len(used)  # refused once, not asked again
        assert [tcp_mesh.edges[i].mux_calls for i in used] == [1] * len(used)
    finally:
        for other in others:
            other.close()
            await other.finish()


async def test_the_transport_can_be_turned_off(tokenizer: Tokenizer, redis_url: str) -> None:
    async with open_mesh(tokenizer, redis_url, edge_stream=True, worker_stream_transport=False) as mesh:
        for i in range(3):
            assert final(await generate(mesh, request(f"grpc {i}", routing=EDGE))).usage.completion_tokens == 4
        assert _connections(mesh) == [0, 0]
        assert sum(e.mux_calls for e in mesh.edges) >= 1
