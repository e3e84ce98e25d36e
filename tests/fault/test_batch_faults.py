"""A batch survives a kill -9 of its runner and of a worker mid-batch: every input line ends with
exactly one result in the output file (none lost, none twice). Driven through the gateway's gRPC
Batches service (the same API the HTTP adapter relays)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import redis.asyncio as aioredis

from services.common.pb.meshserve.v1 import batch_pb2 as bpb
from services.common.pb.meshserve.v1 import batch_pb2_grpc
from services.local.mesh import Mesh
from services.store.batches import GROUP
from services.store.keys import BATCH_WORK_STREAM
from tests.fault.conftest import auth, restart

pytestmark = pytest.mark.fault
LINES = 12
BOUND_S = 150.0


def _input() -> bytes:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"Write a sentence about the number {i}.", "max_tokens": 24, "temperature": 0},
        }
        for i in range(LINES)
    ]
    return "\n".join(json.dumps(x) for x in lines).encode()


async def _batch(stub: batch_pb2_grpc.BatchesStub, batch_id: str) -> bpb.BatchObject:
    return await stub.GetBatch(bpb.BatchRef(batch_id=batch_id), metadata=auth(), timeout=10)


async def test_killing_the_runner_and_a_worker_mid_batch_loses_and_duplicates_nothing(fault_mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(fault_mesh.gateway_address) as channel:
        stub = batch_pb2_grpc.BatchesStub(channel)
        upload = await stub.CreateFile(
            bpb.CreateFileRequest(filename="in.jsonl", purpose="batch", content=_input()), metadata=auth()
        )
        batch = await stub.CreateBatch(
            bpb.CreateBatchRequest(input_file_id=upload.id, endpoint="/v1/completions", completion_window="1h"),
            metadata=auth(),
        )
        deadline = time.monotonic() + BOUND_S
        while (await _batch(stub, batch.id)).request_counts.completed < 2:  # the runner is mid-batch
            assert time.monotonic() < deadline, "the batch made no progress"
            await asyncio.sleep(0.1)
        await fault_mesh.processes["batch"].kill()  # SIGKILL: its lines in flight stay pending in the group
        await fault_mesh.processes["edge-1"].kill()
        mid = await _batch(stub, batch.id)
        assert mid.request_counts.completed < LINES, "the batch ended before the faults; make it longer"
        client = aioredis.Redis.from_url(fault_mesh.redis_url)
        held = (await client.xpending(BATCH_WORK_STREAM, GROUP))["pending"]
        await client.aclose()
        assert held > 0, "the runner held no line when it was killed"
        # The worker comes back in the background (later tests need it); the batch goes on without it.
        worker = asyncio.create_task(restart(fault_mesh, "edge-1", "MESHSERVE_EDGE_WORKER_PORT"))
        await restart(fault_mesh, "batch", "MESHSERVE_BATCH_PORT")  # a new consumer: takes over the dead one's lines
        while (done := await _batch(stub, batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"batch still {done.status} ({done.request_counts}) after {BOUND_S} s"
            await asyncio.sleep(0.3)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            LINES,
            LINES,
            0,
        )
        call = stub.GetFileContent(bpb.FileRef(file_id=done.output_file_id), metadata=auth())
        output = [json.loads(x) for x in b"".join([p.content async for p in call]).splitlines()]
        ids = [o["custom_id"] for o in output]
        assert sorted(ids) == sorted(f"line-{i}" for i in range(LINES)), "a line is missing or written twice"
        assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"][0]["text"] for o in output)
        await worker
