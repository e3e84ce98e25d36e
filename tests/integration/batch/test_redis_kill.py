"""A batch survives a kill -9 of Redis itself when persistence is on (AOF): the runner rides out the
outage, Redis comes back from its append-only file, and every line ends with exactly one result.
The Redis is the state Redis as `meshserve up` starts it (:meth:`Mesh.start_redis`: its flags, its
data directory), restarted with the same command line as its supervisor would.
A runner in this process, lines answered by a small stand-in router (no model needed here: what
is under test is the store and the runner)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from services.batch.capacity import Capacity
from services.batch.config import BatchSettings
from services.batch.runner import Runner
from services.common.config import ServiceSettings
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.processes import ServiceProcess
from services.common.serving import RunningServer, start_server
from services.gateway.servicer import SERVICE_NAME
from services.local.mesh import STATE_REDIS, Mesh, MeshConfig
from services.local.redis_server import wait_redis
from services.store.batches import BatchStore, parse_input

pytestmark = pytest.mark.integration
TOKEN = "batch-redis-kill-token"
LINES = 30


class SlowRouter(inference_pb2_grpc.InferenceServicer):
    """Answers each completion after 20 ms, so the batch is mid-way when Redis dies."""

    async def Complete(self, request, context):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.02)
        usage = pb.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
        return pb.GenerateResponse(text="ok", final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=usage))

    async def ListModels(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="stand-in")])


@pytest.fixture
async def durable_redis(tmp_path: Path) -> AsyncIterator[Mesh]:
    """Only the state Redis of a mesh (the cache Redis is given: it plays no part here)."""
    mesh = Mesh(MeshConfig(redis_url="redis://127.0.0.1:1/0", state_redis_url="", state_dir=str(tmp_path)))
    try:
        await mesh.start_redis()
        yield mesh
    finally:
        await mesh.stop()


@pytest.fixture
async def router() -> AsyncIterator[RunningServer]:
    servicer = SlowRouter()
    server = await start_server(
        ServiceSettings(host="127.0.0.1", port=0, metrics_port=-1, internal_token=TOKEN),
        register=lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, s),
        service_names=[SERVICE_NAME],
        internal=True,
    )
    yield server
    await server.stop()


async def test_a_kill_9_of_a_persistent_redis_loses_and_duplicates_nothing(
    durable_redis: Mesh, router: RunningServer
) -> None:
    url = durable_redis.state_redis_url
    redis_proc: ServiceProcess = durable_redis.redis_processes[STATE_REDIS]
    settings = BatchSettings(
        redis_url=url,
        router_addresses=f"127.0.0.1:{router.port}",
        internal_token=TOKEN,
        claim_idle_s=1,
        sweep_interval_s=0.2,
        shutdown_grace_s=1,
    )
    client = aioredis.Redis.from_url(url)
    store = BatchStore(client)
    await store.ensure_group()
    rows = [
        json.dumps({"custom_id": f"k{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": f"p{i}"}})
        for i in range(LINES)
    ]
    lines = parse_input("\n".join(rows).encode(), "/v1/completions", max_lines=LINES)
    batch = await store.create(
        "acme",
        input_file_id="file-x",
        endpoint="/v1/completions",
        completion_window="1h",
        window_s=3600,
        metadata={},
        lines=lines,
    )
    channel = grpc.aio.insecure_channel(settings.routers()[0])
    runner_redis = aioredis.Redis.from_url(url)
    capacity = Capacity([], (), max_in_flight=2, reserve_slots=0, poll_s=0.2)  # no view: one line at a time
    runner = Runner(settings, BatchStore(runner_redis), [inference_pb2_grpc.InferenceStub(channel)], capacity)
    task = asyncio.create_task(runner.run())
    try:
        deadline = time.monotonic() + 60
        while (await store.get("acme", batch.id)).completed < 8:
            assert time.monotonic() < deadline, "the batch made no progress"
            await asyncio.sleep(0.02)
        await redis_proc.kill()  # SIGKILL
        await asyncio.sleep(0.5)  # the runner meets the outage
        await redis_proc.respawn()  # same command line (port, directory): replays the append-only file
        await wait_redis(url, 30)
        while (done := await _get(store, batch.id)) is None or done.status != "completed":
            assert time.monotonic() < deadline, f"batch not completed: {done}"
            await asyncio.sleep(0.1)
        assert (done.total, done.completed, done.failed) == (LINES, LINES, 0)
        output = (await store.files.content("acme", done.output_file_id)).splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in output) == sorted(f"k{i}" for i in range(LINES))
    finally:
        runner.stop()
        await asyncio.wait_for(task, 10)
        await channel.close()
        await runner_redis.aclose()
        await client.aclose()


async def _get(store: BatchStore, batch_id: str):  # type: ignore[no-untyped-def]
    try:
        return await store.get("acme", batch_id)
    except (OSError, aioredis.ConnectionError):
        return None
