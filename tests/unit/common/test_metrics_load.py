"""Queue-depth and batch-size gauges: read from the live admission state at scrape time."""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial

import aiohttp
import grpc
from prometheus_client import REGISTRY

from services.common.config import load_settings
from services.common.metrics import track_load
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.router.balancer.slo_queue import Admission as RouterAdmission
from services.router.balancer.tiers import TierName
from services.worker.config import WorkerSettings
from services.worker.server import start_worker
from services.worker.slots import Admission as WorkerAdmission
from tests.unit.worker.fakes import TOKENIZER, FakeEngine
from tests.worker_helpers import generate, stats


def _gauges(service: str, tier: str) -> tuple[float | None, float | None]:
    labels = {"service": service, "tier": tier}
    return (
        REGISTRY.get_sample_value("meshserve_queue_depth", labels),
        REGISTRY.get_sample_value("meshserve_batch_size", labels),
    )


async def test_worker_gauges_follow_its_admission_queue() -> None:
    admission = WorkerAdmission(max_active=1, max_queue=4)
    track_load("test_worker", "edge", queued=lambda: admission.queued, active=lambda: admission.active)
    never = asyncio.Event()
    assert await admission.acquire(never)
    assert _gauges("test_worker", "edge") == (0.0, 1.0)

    waiters = [asyncio.create_task(admission.acquire(never)) for _ in range(2)]
    await asyncio.sleep(0)  # let both reach the queue
    assert _gauges("test_worker", "edge") == (2.0, 1.0)

    admission.release()
    assert await waiters[0]
    assert _gauges("test_worker", "edge") == (1.0, 1.0)
    admission.release()
    assert await waiters[1]
    admission.release()
    assert _gauges("test_worker", "edge") == (0.0, 0.0)


async def test_router_gauges_follow_each_tiers_fair_queue() -> None:
    admission = RouterAdmission(lambda tier: 1)
    for tier in TierName:
        track_load("test_router", tier, queued=partial(admission.waiting, tier), active=partial(admission.busy, tier))
    first = await admission.acquire(TierName.EDGE, tenant="a", priority=0, cost=1, uncached_tokens=0)
    second = asyncio.create_task(admission.acquire(TierName.EDGE, tenant="b", priority=0, cost=1, uncached_tokens=0))
    await asyncio.sleep(0)
    assert _gauges("test_router", "edge") == (1.0, 1.0)
    assert _gauges("test_router", "cloud") == (0.0, 0.0)
    admission.release(first)
    admission.release(await second)
    assert _gauges("test_router", "edge") == (0.0, 0.0)


async def _scrape(port: int) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as reply:
        assert reply.status == 200
        return await reply.text()


def _sample(text: str, name: str, service: str, tier: str) -> float:
    (line,) = [row for row in text.splitlines() if row.startswith(f'{name}{{service="{service}",tier="{tier}"}}')]
    return float(line.rsplit(" ", 1)[1])


async def test_a_serving_worker_exposes_its_load_on_metrics() -> None:
    """Over the real /metrics endpoint: one sequence held mid-generation, one waiting behind it."""
    engine = FakeEngine()
    settings = load_settings(WorkerSettings, port=0, metrics_port=0, max_active_sequences=1, max_queue=4)
    worker = await start_worker(settings, engine, tier="edge")
    engine.gate = threading.Semaphore(0)  # after the warm-up: hold every step from now on
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    prompt = TOKENIZER.encode("hi")
    turns = [asyncio.create_task(generate(stub, prompt, max_tokens=2)) for _ in range(2)]
    try:
        assert worker.server.metrics_port is not None
        deadline = time.monotonic() + 10
        while (await stats(stub)).queue_depth < 1:  # bounded wait for the second turn to queue
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        text = await _scrape(worker.server.metrics_port)
        assert _sample(text, "meshserve_queue_depth", "common", "edge") == 1.0
        assert _sample(text, "meshserve_batch_size", "common", "edge") == 1.0
        assert "# TYPE meshserve_queue_depth gauge" in text
    finally:
        for _ in range(8):
            engine.gate.release()
        await asyncio.gather(*turns)
        await channel.close()
        await worker.stop()
