"""Outlier ejection against real gRPC probes: an ejected replica stays out for its backoff even though
its health says SERVING, then comes back carrying a load penalty, so it takes a smaller share of new
traffic than its peer until the penalty has decayed."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.router.balancer.policies.base import Candidate
from services.router.balancer.policies.cache_aware import CacheAware
from services.router.balancer.registry import Registry
from tests.integration.router.fake_worker import start_fake
from tests.integration.router.harness import TOKEN

pytestmark = pytest.mark.integration


async def test_ejected_replica_waits_out_its_backoff_then_takes_traffic_gradually() -> None:
    fakes = [await start_fake(f"edge-{i}", pb.TIER_EDGE, TOKEN) for i in range(2)]
    registry = Registry(
        [f.address for f in fakes], [], internal_token=TOKEN, interval_s=3600, eject_base_s=0.3, readmit_s=60
    )
    await registry.start()  # one probe round; the background poll waits an hour, we probe by hand
    try:
        a, b = registry.replicas
        assert a.healthy and b.healthy and a.load == b.load == 0
        registry.mark_down(a, "call_failed")
        await registry.probe_all()
        assert not a.healthy, "health says SERVING, but the ejection backoff has not passed"

        async def readmitted() -> None:
            while not a.healthy:
                await asyncio.sleep(0.05)  # polling the backoff's end through real probes
                await registry.probe_all()

        await asyncio.wait_for(readmitted(), 10)
        assert a.ejections == 1 and a.readmitted_at > 0
        assert a.load > b.load == 0  # the re-admission penalty

        selector = CacheAware(rng=random.Random(0))
        share = {a.address: 0, b.address: 0}
        for _ in range(6):  # six concurrent short requests, each held while the next is placed
            pick = selector.select([Candidate(r.address, r.load) for r in (a, b)], [])
            share[pick.name] += 1
            next(r for r in (a, b) if r.address == pick.name).in_flight += 1
        assert share[a.address] < share[b.address]

        registry.mark_down(a, "stalled")  # not yet forgiven: the second ejection counts (backoff doubles)
        await registry.probe_all()
        assert a.ejections == 2 and not a.healthy
    finally:
        await registry.close()
        for f in fakes:
            assert f.server is not None
            await f.server.stop()
