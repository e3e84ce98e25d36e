"""The free-capacity throttle: what a replica view allows (pure; a fake admin stub)."""

from __future__ import annotations

import asyncio

import pytest

from services.batch.capacity import Capacity, combine
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as rpb


def replica(
    worker: str, *, size: int = 4, in_flight: int = 0, active: int = 0, queue: int = 0, healthy: bool = True
) -> rpb.ReplicaStatus:
    return rpb.ReplicaStatus(
        worker_id=worker,
        healthy=healthy,
        max_active_sequences=size,
        in_flight=in_flight,
        active_sequences=active,
        queue_depth=queue,
    )


def test_combine_takes_the_busiest_view_of_each_replica() -> None:
    a = rpb.ListReplicasResponse(
        replicas=[replica("e0", in_flight=1), replica("e1", active=3), replica("x", healthy=False)]
    )
    b = rpb.ListReplicasResponse(replicas=[replica("e0", in_flight=2)])  # another router's view of e0
    view = combine([a, b])
    assert (view.free_slots, view.queued, view.replicas) == ((4 - 2) + (4 - 3), 0, 2)
    assert combine([rpb.ListReplicasResponse(replicas=[replica("e0", active=4, queue=2)])]).queued == 2


class FakeRouterAdmin:
    """One replica of 4 slots whose router counts the capacity's lines in flight, plus ``other`` requests."""

    def __init__(self) -> None:
        self.capacity: Capacity | None = None
        self.other = 0
        self.queue = 0

    async def ListReplicas(self, request, **_call_options):  # type: ignore[no-untyped-def]
        assert self.capacity is not None
        used = self.capacity.in_flight + self.other
        return rpb.ListReplicasResponse(replicas=[replica("e0", size=4, in_flight=used, queue=self.queue)])


async def test_lines_start_only_in_free_slots_above_the_reserve() -> None:
    admin = FakeRouterAdmin()
    capacity = Capacity([admin], (), max_in_flight=8, reserve_slots=1, poll_s=0.01)  # type: ignore[list-item]
    admin.capacity = capacity
    poller = asyncio.create_task(capacity.poll_forever())
    try:
        for _ in range(3):  # 4 free slots, 1 reserved: 3 lines
            await asyncio.wait_for(capacity.acquire(), 1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(capacity.acquire(), 0.1)  # 1 free = the reserve
        await capacity.release()
        admin.other = 1  # an interactive request took the freed slot
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(capacity.acquire(), 0.1)
        admin.other, admin.queue = 0, 1  # a queue somewhere: nothing starts
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(capacity.acquire(), 0.1)
        admin.queue = 0
        await asyncio.wait_for(capacity.acquire(), 1)
        assert capacity.in_flight == 3
    finally:
        poller.cancel()


async def test_without_a_view_one_line_at_a_time() -> None:
    capacity = Capacity([], (), max_in_flight=8, reserve_slots=0, poll_s=0.01)
    poller = asyncio.create_task(capacity.poll_forever())
    try:
        await asyncio.wait_for(capacity.acquire(), 1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(capacity.acquire(), 0.05)
        await capacity.release()
        await asyncio.wait_for(capacity.acquire(), 1)
    finally:
        poller.cancel()


async def test_an_idle_runner_asks_the_routers_nothing() -> None:
    admin = FakeRouterAdmin()
    calls = 0
    answer = admin.ListReplicas

    async def counted(request, **options):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return await answer(request, **options)

    admin.ListReplicas = counted  # type: ignore[method-assign]
    capacity = Capacity([admin], (), max_in_flight=8, reserve_slots=0, poll_s=0.01)  # type: ignore[list-item]
    admin.capacity = capacity
    poller = asyncio.create_task(capacity.poll_forever())
    try:
        await asyncio.wait_for(capacity.acquire(), 1)  # waits for a fresh view
        await capacity.release()
        await asyncio.sleep(0.05)
        idle = calls
        await asyncio.sleep(0.1)
        assert calls == idle  # nothing waits or runs: no polling
        await asyncio.wait_for(capacity.acquire(), 1)
        assert calls > idle
    finally:
        poller.cancel()
