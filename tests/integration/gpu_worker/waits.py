"""Waits on a running cloud worker's load report (bounded polls of a condition, not of readiness)."""

from __future__ import annotations

import asyncio

from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from tests.worker_helpers import stats


async def wait_kv_freed(stub: worker_pb2_grpc.WorkerStub, timeout_s: float = 30.0) -> None:
    """Until the worker holds no KV: a cancelled turn ends for its caller at once, and its stop reaches
    the engine loop between two steps (after the step in flight)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await stats(stub)).kv_used_bytes:
        assert asyncio.get_running_loop().time() < deadline, "the worker never freed the cancelled turn's KV"
        await asyncio.sleep(0.02)  # polling a condition, not readiness
