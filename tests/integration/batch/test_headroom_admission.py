"""Admission by measured headroom on real components: a real edge worker (the real small model), a real
router, a real Redis and a runner in this process. While interactive requests run on the router no
batch line starts; when they stop, the batch finishes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import redis.asyncio as aioredis

from services.batch.capacity import Capacity, Headroom
from services.batch.config import BatchSettings
from services.batch.runner import Runner
from services.common import metadata as md
from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as rpb
from services.common.pb.meshserve.internal.v1 import router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.server import start_edge_worker
from services.router.config import RouterSettings
from services.router.server import start_router_api
from services.store.batches import BatchStore, parse_input
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration
TOKEN = "batch-headroom-token"
LINES = 4
AUTH = ((md.INTERNAL_TOKEN, TOKEN),)
DB = 9  # the session Redis's db 0 is other tests'; this test empties only its own database


@pytest.fixture
async def router_port(redis_srv: RedisServer) -> AsyncIterator[int]:
    worker = await start_edge_worker(
        load_settings(
            EdgeWorkerSettings,
            port=0,
            threads=1,
            max_active_sequences=4,
            worker_id="edge-headroom",
            internal_token=TOKEN,
            warmup=False,
        )
    )
    settings = load_settings(
        RouterSettings,
        edge_workers=f"127.0.0.1:{worker.port}",
        redis_url=redis_srv.url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        cache_retry_after_s=0,
    )
    server, _api = await start_router_api(settings)
    try:
        yield server.port
    finally:
        await server.stop()
        await worker.stop()


async def interactive_loop(stub: inference_pb2_grpc.InferenceStub, stop: asyncio.Event, name: str) -> int:
    """Back-to-back interactive requests (64 tokens each) until ``stop``; how many ran."""
    metadata = ((md.INTERNAL_TOKEN, TOKEN), (md.TENANT, "acme"), (md.REQUEST_ID, name))
    done = 0
    while not stop.is_set():
        request = pb.GenerateRequest(
            prompt=f"Interactive {name}-{done}. Once upon a time",
            sampling=pb.SamplingParams(max_tokens=64, min_tokens=64, temperature=0),
            routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
        )
        async for _frame in stub.Generate(request, metadata=metadata, timeout=120):
            pass
        done += 1
    return done


async def test_no_line_starts_while_interactive_requests_run_and_the_batch_ends_after(
    redis_srv: RedisServer, router_port: int
) -> None:
    url = f"{redis_srv.url}/{DB}"
    client = aioredis.Redis.from_url(url)
    await client.flushdb()
    store = BatchStore(client)
    await store.ensure_group()
    rows = [
        json.dumps(
            {
                "custom_id": f"h{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": f"Line {i}.", "max_tokens": 4, "temperature": 0},
            }
        )
        for i in range(LINES)
    ]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router_port}")
    stub = inference_pb2_grpc.InferenceStub(channel)
    stop = asyncio.Event()
    loops = [asyncio.create_task(interactive_loop(stub, stop, f"i{k}")) for k in range(2)]
    settings = BatchSettings(
        redis_url=url, router_addresses=f"127.0.0.1:{router_port}", internal_token=TOKEN, shutdown_grace_s=1
    )
    room = Headroom(max_lines=4, quiet_s=0.3, max_defer_s=1000.0, now=time.monotonic())
    capacity = Capacity(
        [router_admin_pb2_grpc.RouterAdminStub(channel)],
        AUTH,
        max_in_flight=4,
        reserve_slots=0,
        poll_s=0.05,
        headroom=room,
    )
    admin = router_admin_pb2_grpc.RouterAdminStub(channel)
    task: asyncio.Task[None] | None = None
    runner_redis = aioredis.Redis.from_url(url)
    runner = Runner(settings, BatchStore(runner_redis), [stub], capacity)
    try:
        deadline = time.monotonic() + 30
        while (
            sum(r.in_flight for r in (await admin.ListReplicas(rpb.ListReplicasRequest(), metadata=AUTH)).replicas) < 2
        ):
            assert time.monotonic() < deadline, "the interactive requests never ran"
            await asyncio.sleep(0.05)
        lines = parse_input("\n".join(rows).encode(), "/v1/completions", max_lines=LINES)
        batch = await store.create(
            "acme",
            input_file_id="file-h",
            endpoint="/v1/completions",
            completion_window="1h",
            window_s=3600,
            metadata={},
            lines=lines,
        )
        task = asyncio.create_task(runner.run())
        watch_until = time.monotonic() + 4
        while time.monotonic() < watch_until:  # the line waits: interactive work never left the router
            assert capacity.in_flight == 0, "a batch line started while interactive requests ran"
            await asyncio.sleep(0.02)
        assert room.busy and (await store.get("acme", batch.id)).completed == 0
        stop.set()
        ran = await asyncio.gather(*loops)
        assert sum(ran) >= 2
        deadline = time.monotonic() + 60
        while (done := await store.get("acme", batch.id)).status != "completed":
            assert time.monotonic() < deadline, f"the batch did not finish once the interactive load stopped: {done}"
            await asyncio.sleep(0.1)
        assert (done.completed, done.failed) == (LINES, 0)
    finally:
        stop.set()
        for loop in loops:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await loop
        runner.stop()
        if task is not None:
            await asyncio.wait_for(task, 10)
        await channel.close()
        await runner_redis.aclose()
        await client.flushdb()
        await client.aclose()
