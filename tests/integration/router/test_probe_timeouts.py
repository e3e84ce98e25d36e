"""Health probes against real gRPC workers: a worker that answers late (busy) keeps its place until
several probes in a row time out; one that is gone is marked down by the first probe."""

from __future__ import annotations

import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.router.balancer.registry import Registry
from tests.integration.router.fake_worker import start_fake
from tests.integration.router.harness import TOKEN

pytestmark = pytest.mark.integration


async def test_late_probe_answers_need_several_in_a_row_but_a_dead_worker_goes_at_once() -> None:
    slow = await start_fake("edge-slow", pb.TIER_EDGE, TOKEN)
    gone = await start_fake("edge-gone", pb.TIER_EDGE, TOKEN)
    registry = Registry(
        [slow.address, gone.address], [], internal_token=TOKEN, interval_s=3600, timeout_s=0.2,
        probe_timeouts_to_down=3,
    )  # fmt: skip
    await registry.start()  # one probe round; we probe by hand after that
    try:
        a, b = registry.replicas
        assert a.healthy and b.healthy

        slow.stats_delay_s = 1.0  # every probe now times out
        for expected_timeouts in (1, 2):
            await registry.probe_all()
            assert a.probe_timeouts == expected_timeouts
            assert a.healthy, "a late answer or two does not take a busy worker out"
        await registry.probe_all()
        assert a.probe_timeouts == 3 and not a.healthy, "three late answers in a row do"

        slow.stats_delay_s = 0.0
        await registry.probe_all()
        assert a.healthy and a.probe_timeouts == 0, "an answer in time brings it back and resets the count"

        slow.stats_delay_s = 1.0  # one late answer after a good one: still up (the count restarted)
        await registry.probe_all()
        assert a.healthy and a.probe_timeouts == 1

        assert gone.server is not None
        await gone.server.stop()
        await registry.probe_all()
        assert not b.healthy, "a refused connection marks the worker down at the first probe"
    finally:
        await registry.close()
        slow.stats_delay_s = 0.0
        assert slow.server is not None
        await slow.server.stop()
