"""Admission by measured headroom: lines start only while the interactive work is idle, ramp up by one
per quiet view, halve at every busy one, and never starve (pure; a fake clock and a fake admin stub)."""

from __future__ import annotations

import asyncio

import pytest

from services.batch.capacity import Capacity, Headroom, combine
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as rpb


def headroom(now: float = 0.0, *, max_lines: int = 4, quiet_s: float = 1.0, max_defer_s: float = 30.0) -> Headroom:
    return Headroom(max_lines=max_lines, quiet_s=quiet_s, max_defer_s=max_defer_s, now=now)


def test_no_line_starts_while_interactive_work_runs_or_until_it_has_been_quiet() -> None:
    h = headroom()
    h.observe(interactive=2, now=10.0)
    assert not h.allows(in_flight=0, now=10.0)
    h.observe(interactive=0, now=10.5)  # idle, but not yet for quiet_s
    assert not h.allows(in_flight=0, now=10.5)
    h.observe(interactive=0, now=11.0)
    assert h.allows(in_flight=0, now=11.0)


def test_lines_grow_by_one_per_quiet_view_and_halve_at_a_busy_one() -> None:
    h = headroom(max_lines=4, quiet_s=0.0)
    assert h.limit == 1
    for step in range(1, 6):
        h.observe(interactive=0, now=float(step))
    assert h.limit == 4  # additive increase, capped at max_lines
    assert h.allows(in_flight=3, now=6.0) and not h.allows(in_flight=4, now=6.0)
    h.observe(interactive=1, now=7.0)
    assert h.limit == 2
    h.observe(interactive=1, now=8.0)
    h.observe(interactive=1, now=9.0)
    assert h.limit == 1  # never below one: the next quiet moment starts a line


def test_a_load_that_never_idles_still_gets_one_line_per_max_defer_s() -> None:
    h = headroom(now=0.0, quiet_s=1.0, max_defer_s=30.0)
    h.observe(interactive=1, now=29.0)
    assert not h.allows(in_flight=0, now=29.0)
    h.observe(interactive=1, now=30.0)
    assert h.allows(in_flight=0, now=30.0)  # starved for max_defer_s: one line
    assert not h.allows(in_flight=1, now=30.0)  # alone
    h.started(now=30.0)
    h.observe(interactive=1, now=45.0)
    assert not h.allows(in_flight=0, now=45.0)
    assert h.allows(in_flight=0, now=60.0)


def test_the_routers_turns_add_up_over_routers_and_replicas() -> None:
    a = rpb.ListReplicasResponse(
        replicas=[rpb.ReplicaStatus(worker_id="e0", healthy=True, max_active_sequences=4, in_flight=2)]
    )
    b = rpb.ListReplicasResponse(
        replicas=[
            rpb.ReplicaStatus(worker_id="e0", healthy=True, max_active_sequences=4, in_flight=1),
            rpb.ReplicaStatus(worker_id="e1", healthy=False, max_active_sequences=4, in_flight=1),
        ]
    )
    assert combine([a, b]).in_flight == 4  # each router counts only its own turns


def test_the_routers_background_turns_add_up_too() -> None:
    a = rpb.ListReplicasResponse(
        replicas=[
            rpb.ReplicaStatus(worker_id="e0", healthy=True, max_active_sequences=4, in_flight=3, background_in_flight=2)
        ]
    )
    b = rpb.ListReplicasResponse(
        replicas=[
            rpb.ReplicaStatus(worker_id="e0", healthy=True, max_active_sequences=4, in_flight=1, background_in_flight=1)
        ]
    )
    view = combine([a, b])
    assert (view.in_flight, view.background) == (4, 3)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeRouterAdmin:
    """One replica of 8 slots; the router counts the runner's calls plus ``interactive`` turns, and
    ``others``: another runner's lines, which it reports as background when ``counts_background``."""

    def __init__(self, *, counts_background: bool = False) -> None:
        self.capacity: Capacity | None = None
        self.interactive = 0
        self.others = 0
        self.counts_background = counts_background

    async def ListReplicas(self, request, **_call_options):  # type: ignore[no-untyped-def]
        assert self.capacity is not None
        background = self.capacity.calling + self.others
        turns = background + self.interactive
        status = rpb.ReplicaStatus(worker_id="e0", healthy=True, max_active_sequences=8, in_flight=turns)
        if self.counts_background:
            status.background_in_flight = background
        return rpb.ListReplicasResponse(replicas=[status])


async def started_within(capacity: Capacity, seconds: float) -> bool:
    try:
        await asyncio.wait_for(capacity.acquire(), seconds)
    except TimeoutError:
        return False
    return True


async def test_capacity_waits_for_interactive_work_to_end_and_not_for_its_own_calls() -> None:
    admin = FakeRouterAdmin()
    clock = Clock()
    room = Headroom(max_lines=4, quiet_s=0.0, max_defer_s=1000.0, now=clock.now)
    capacity = Capacity([admin], (), max_in_flight=4, reserve_slots=0, poll_s=0.01, headroom=room, clock=clock)  # type: ignore[list-item]
    admin.capacity = capacity
    poller = asyncio.create_task(capacity.poll_forever())
    try:
        admin.interactive = 1
        assert not await started_within(capacity, 0.1)  # an interactive turn runs: nothing starts
        admin.interactive = 0
        assert await started_within(capacity, 1)
        with capacity.call():  # the line's own call: not interactive work
            assert await started_within(capacity, 1)  # the limit grew with the quiet views
            admin.interactive = 2
            await asyncio.sleep(0.05)
            assert not await started_within(capacity, 0.1)
            assert room.limit == 1
        admin.interactive = 0
        await capacity.release()
        await capacity.release()
        assert await started_within(capacity, 1)
    finally:
        poller.cancel()


async def test_another_runners_lines_are_not_taken_for_interactive_work() -> None:
    admin = FakeRouterAdmin(counts_background=True)
    clock = Clock()
    room = Headroom(max_lines=4, quiet_s=0.0, max_defer_s=1000.0, now=clock.now)
    capacity = Capacity([admin], (), max_in_flight=4, reserve_slots=0, poll_s=0.01, headroom=room, clock=clock)  # type: ignore[list-item]
    admin.capacity = capacity
    poller = asyncio.create_task(capacity.poll_forever())
    try:
        admin.others = 3  # another runner's lines, marked background by the router
        assert await started_within(capacity, 1)
        admin.interactive = 1
        await asyncio.sleep(0.05)
        assert not await started_within(capacity, 0.1)  # interactive work still holds lines back
    finally:
        poller.cancel()


async def test_capacity_starts_a_starved_line_alone_after_max_defer_s() -> None:
    admin = FakeRouterAdmin()
    clock = Clock()
    room = Headroom(max_lines=4, quiet_s=0.0, max_defer_s=30.0, now=clock.now)
    capacity = Capacity([admin], (), max_in_flight=4, reserve_slots=0, poll_s=0.01, headroom=room, clock=clock)  # type: ignore[list-item]
    admin.capacity = capacity
    admin.interactive = 3  # never idle
    poller = asyncio.create_task(capacity.poll_forever())
    try:
        assert not await started_within(capacity, 0.1)
        clock.now += 30.0
        assert await started_within(capacity, 1)
        assert not await started_within(capacity, 0.1)  # alone, and the clock starts again
        await capacity.release()
        assert not await started_within(capacity, 0.1)
        clock.now += 30.0
        assert await started_within(capacity, 1)
    finally:
        poller.cancel()


@pytest.mark.parametrize("headroom_on", [False, True])
async def test_without_a_view_one_line_at_a_time_either_way(headroom_on: bool) -> None:
    room = Headroom(max_lines=4, quiet_s=0.0, max_defer_s=30.0, now=0.0) if headroom_on else None
    capacity = Capacity([], (), max_in_flight=8, reserve_slots=0, poll_s=0.01, headroom=room)
    poller = asyncio.create_task(capacity.poll_forever())
    try:
        assert await started_within(capacity, 1)
        assert not await started_within(capacity, 0.05)
    finally:
        poller.cancel()


def test_the_unseen_part_of_a_slow_busy_gap_counts_as_busy() -> None:
    h = headroom(quiet_s=0.5)
    h.observe(interactive=1, now=10.0)
    h.observe(interactive=0, now=11.0, unseen_s=0.8)  # read 1 s later where 0.2 s was due
    assert not h.allows(in_flight=0, now=11.0)  # quiet since 10.8 at the earliest, not since 10.0
    h.observe(interactive=0, now=11.2)
    assert not h.allows(in_flight=0, now=11.2)
    h.observe(interactive=0, now=11.4)
    assert h.allows(in_flight=0, now=11.4)


async def test_the_view_is_read_less_often_while_it_shows_interactive_work() -> None:
    admin = FakeRouterAdmin(counts_background=True)
    room = Headroom(max_lines=4, quiet_s=0.0, max_defer_s=1000.0, now=0.0)
    capacity = Capacity([admin], (), max_in_flight=4, reserve_slots=0, poll_s=0.01, busy_poll_s=0.2, headroom=room)  # type: ignore[list-item]
    admin.capacity = capacity
    poller = asyncio.create_task(capacity.poll_forever())
    try:
        admin.interactive = 1
        waiting = asyncio.create_task(capacity.acquire())
        await asyncio.sleep(0.5)
        busy_views = capacity.views
        assert 1 <= busy_views <= 5  # every 0.2 s, not every 0.01 s
        admin.interactive = 0
        await asyncio.wait_for(waiting, 2)  # the next view sees the quiet and starts the line
        await asyncio.sleep(0.2)
        assert capacity.views - busy_views >= 5  # quiet: every 0.01 s again
    finally:
        poller.cancel()
