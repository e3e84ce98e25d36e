"""Queue-depth and batch-size gauges: read from the live admission state at scrape time."""

from __future__ import annotations

import asyncio
from functools import partial

from prometheus_client import REGISTRY

from services.common.metrics import track_load
from services.common.worker.admission import Admission as WorkerAdmission
from services.router.admission import Admission as RouterAdmission
from services.router.policy import TierName


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
