"""The router's worker streams on one GenerateMux call per worker (services/router/mux.py), over real
gRPC against fake workers serving it with the worker runtime's own serve_mux."""

from __future__ import annotations

import asyncio

import grpc

from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.settings import load_settings
from services.common.tokenizer import Tokenizer
from services.router.config import RouterSettings
from services.router.server import start_router
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


async def test_concurrent_requests_share_one_call_per_worker(tokenizer: Tokenizer, redis_url: str) -> None:
    # 6 slots per edge: all 12 fit on the edges at once (the default 4 would spill the rest to the
    # cloud whenever all 12 are in flight together, as on a slow machine)
    async with open_mesh(tokenizer, redis_url, replica_slots=6) as mesh:
        prompts = [f"Question number {i}?" for i in range(12)]
        results = await asyncio.gather(*(generate(mesh, request(p, max_tokens=5, routing=EDGE)) for p in prompts))
        assert all(final(frames).usage.completion_tokens == 5 for frames in results)
        assert sum(len(e.starts) for e in mesh.edges) == 12
        assert [e.mux_calls for e in mesh.edges] == [1, 1]  # every stream rode the worker's one call


async def test_a_broken_call_fails_only_its_streams_and_the_next_request_reconnects(mesh: Mesh) -> None:
    assert final(await generate(mesh, request("first", routing=EDGE))).usage.completion_tokens == 4
    for replica in mesh.router.registry.replicas:
        if replica.mux is not None:
            replica.mux.retire()  # ends the idle call
    await asyncio.sleep(0.1)
    assert final(await generate(mesh, request("second", routing=EDGE))).usage.completion_tokens == 4
    assert sum(e.mux_calls for e in mesh.edges) >= 2  # a new call was opened


async def test_worker_death_mid_stream_resumes_elsewhere(mesh: Mesh) -> None:
    async def kill(worker: FakeWorker) -> None:
        assert worker.server is not None
        await worker.server.server.stop(0)  # the whole worker goes away: its GenerateMux call breaks

    frames, serving = await kill_mid_stream(mesh, kill, EDGE)
    tokens = [t for f in frames for t in f.token_ids]
    assert len(tokens) == 30
    fin = final(frames)
    assert fin.route.worker_id != serving.worker_id  # finished by the other edge worker


class OldWorker(FakeWorker):
    """A worker from before GenerateMux: the method answers UNIMPLEMENTED."""

    GenerateMux = worker_pb2_grpc.WorkerServicer.GenerateMux


async def test_a_worker_without_mux_is_served_with_generate_calls(tokenizer: Tokenizer, redis_url: str) -> None:
    old = await start_fake("old-edge", pb.TIER_EDGE, TOKEN, cls=OldWorker)
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
        first = [f async for f in stub.Generate(request("hello", routing=EDGE), metadata=META)]
        assert final(first).usage.completion_tokens == 4  # the first try failed over; the request did not
        await router.registry.probe_all()
        second = [f async for f in stub.Generate(request("hello again", routing=EDGE), metadata=META)]
        assert final(second).route.worker_id == "old-edge"
        assert old.calls >= 1 and old.mux_calls == 0  # served by a Generate call of its own
    finally:
        await channel.close()
        await server.stop()
        for fake in (old, spare):
            assert fake.server is not None
            await fake.server.stop()
