"""The router's holding, its one wake per version and the idle sweeper (services/router/balancer/wake.py), over fake
replicas and fake Sleep/Wake calls."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from services.common.errors import ResourceExhausted, Unavailable
from services.router.balancer.registry import ModelState, Replica, WorkerReport
from services.router.balancer.tiers import TierName
from services.router.balancer.wake import SLEEP_RETRY_S, Waker, version_state
from services.router.config import IdleSpec
from services.router.metrics import HELD, HELD_TIMEOUTS, WAKES


def _replica(address: str, state: ModelState, *, healthy: bool = True, reported_at: float = 0.0) -> Replica:
    return Replica(
        address,
        TierName.EDGE,
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        healthy=healthy,
        report=WorkerReport(worker_id=address, model_state=state),
        reported_at=reported_at,
    )


class Fleet:
    """Replicas and the Sleep/Wake calls a Waker makes on them (the registry's part)."""

    def __init__(self, *replicas: Replica) -> None:
        self.replicas = list(replicas)
        self.woken: list[str] = []
        self.slept: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: dict[str, Exception] = {}
        self.cancelled: list[str] = []
        self.busy: set[str] = set()
        self.waker: Waker | None = None

    def set_state(self, replica: Replica, state: ModelState) -> None:
        replica.report = replace(replica.report, model_state=state)
        if self.waker is not None:
            self.waker.notify()

    async def wake(self, replica: Replica, timeout_s: float) -> None:
        self.woken.append(replica.address)
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(replica.address)
            raise
        if replica.address in self.fail:
            raise self.fail[replica.address]
        self.set_state(replica, ModelState.AWAKE)

    async def sleep(self, replica: Replica, timeout_s: float) -> bool:
        if replica.address in self.busy:
            return False
        self.slept.append(replica.address)
        self.set_state(replica, ModelState.ASLEEP)
        return True

    def waker_for(self, model: str = "m", *, idle: IdleSpec | None = None, **kw: object) -> Waker:
        self.waker = Waker(
            model=model,
            version="v1",
            replicas=lambda: self.replicas,
            wake=self.wake,
            sleep=self.sleep,
            idle=idle or IdleSpec(),
            **kw,  # type: ignore[arg-type]
        )
        return self.waker


def _count(metric: object, *labels: str) -> float:
    return metric.labels(*labels)._value.get()  # type: ignore[attr-defined]


async def _until(predicate: object, rounds: int = 200) -> None:
    for _ in range(rounds):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_an_awake_replica_means_no_hold() -> None:
    fleet = Fleet(_replica("a:1", ModelState.AWAKE))
    waker = fleet.waker_for()
    await waker.hold()
    assert fleet.woken == [] and waker.held == 0


async def test_one_wake_serves_64_held_requests() -> None:
    fleet = Fleet(_replica("a:1", ModelState.ASLEEP))
    waker = fleet.waker_for("one-wake")
    fleet.gate.clear()
    held = [asyncio.create_task(waker.hold()) for _ in range(64)]
    await _until(lambda: waker.held == 64)
    assert _count(HELD, "one-wake", "v1") == 64
    fleet.gate.set()
    await asyncio.gather(*held)
    assert fleet.woken == ["a:1"]
    assert _count(WAKES, "one-wake", "v1", "ok") == 1
    assert waker.held == 0 and _count(HELD, "one-wake", "v1") == 0


async def test_every_held_request_cancelled_cancels_the_wake() -> None:
    fleet = Fleet(_replica("a:1", ModelState.ASLEEP))
    waker = fleet.waker_for("abandon")
    fleet.gate.clear()
    held = [asyncio.create_task(waker.hold()) for _ in range(3)]
    await _until(lambda: waker.held == 3 and fleet.woken)
    held[0].cancel()
    await asyncio.sleep(0)
    assert fleet.cancelled == []  # two still wait: the wake goes on
    for task in held[1:]:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    await _until(lambda: fleet.cancelled == ["a:1"])
    assert waker.held == 0
    assert _count(WAKES, "abandon", "v1", "abandoned") == 1


async def test_past_the_deadline_unavailable_names_the_model_with_a_retry_after() -> None:
    fleet = Fleet(_replica("a:1", ModelState.ASLEEP))
    waker = fleet.waker_for("slow", deadline_s=0.05)
    fleet.gate.clear()
    with pytest.raises(Unavailable) as caught:
        await waker.hold()
    assert "'slow'" in caught.value.message and "retry after" in caught.value.message
    assert caught.value.retry_after_ms > 0
    assert _count(HELD_TIMEOUTS, "slow", "v1") == 1
    await _until(lambda: fleet.cancelled == ["a:1"])  # nobody waits: the wake stops


async def test_the_request_deadline_bounds_the_hold_too() -> None:
    fleet = Fleet(_replica("a:1", ModelState.ASLEEP))
    waker = fleet.waker_for("short", deadline_s=60)
    fleet.gate.clear()
    with pytest.raises(Unavailable):
        await waker.hold(0.05)


async def test_more_than_max_held_is_resource_exhausted() -> None:
    fleet = Fleet(_replica("a:1", ModelState.ASLEEP))
    waker = fleet.waker_for("full", max_held=2)
    fleet.gate.clear()
    held = [asyncio.create_task(waker.hold()) for _ in range(2)]
    await _until(lambda: waker.held == 2)
    with pytest.raises(ResourceExhausted) as caught:
        await waker.hold()
    assert "'full'" in caught.value.message and caught.value.retry_after_ms > 0
    fleet.gate.set()
    await asyncio.gather(*held)


async def test_a_failed_wake_tries_the_next_asleep_replica() -> None:
    first = _replica("a:1", ModelState.ASLEEP, reported_at=2.0)  # most recent: tried first
    second = _replica("b:1", ModelState.ASLEEP, reported_at=1.0)
    fleet = Fleet(second, first)
    fleet.fail["a:1"] = Unavailable("load failed")
    waker = fleet.waker_for("retry")
    await waker.hold()
    assert fleet.woken == ["a:1", "b:1"]
    assert second.state is ModelState.AWAKE
    assert _count(WAKES, "retry", "v1", "failed") == 1 and _count(WAKES, "retry", "v1", "ok") == 1


async def test_a_wake_failing_everywhere_fails_the_held_requests_and_says_why() -> None:
    fleet = Fleet(_replica("a:1", ModelState.ASLEEP))
    fleet.fail["a:1"] = ResourceExhausted("short of memory")
    waker = fleet.waker_for("nomem")
    results = await asyncio.gather(*(waker.hold() for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, Unavailable) for r in results)
    error = results[0]
    assert isinstance(error, Unavailable)
    assert "'nomem'" in error.message and "memory" in error.message and error.retry_after_ms > 0
    assert fleet.woken == ["a:1"]  # one wake, every held request told
    assert _count(WAKES, "nomem", "v1", "no_memory") == 1
    fleet.fail.clear()
    await waker.hold()  # a later request tries again
    assert fleet.woken == ["a:1", "a:1"]


async def test_a_healthy_replica_preferred_over_a_down_one() -> None:
    down = _replica("a:1", ModelState.ASLEEP, healthy=False, reported_at=9.0)
    up = _replica("b:1", ModelState.ASLEEP, reported_at=1.0)
    fleet = Fleet(down, up)
    await fleet.waker_for("pref").hold()
    assert fleet.woken == ["b:1"]


async def test_a_waking_replica_is_waited_for_not_woken_again() -> None:
    waking = _replica("a:1", ModelState.WAKING)
    fleet = Fleet(waking)
    waker = fleet.waker_for("waiting")
    held = asyncio.create_task(waker.hold())
    await _until(lambda: waker.held == 1)
    fleet.set_state(waking, ModelState.AWAKE)
    await held
    assert fleet.woken == []


async def test_a_replica_that_registers_ends_the_hold_of_a_stopped_version() -> None:
    fleet = Fleet()
    waker = fleet.waker_for("zero", idle=IdleSpec(min_replicas=0, idle_after_s=1))
    held = asyncio.create_task(waker.hold())
    await _until(lambda: waker.held == 1)
    fleet.replicas.append(_replica("new:1", ModelState.AWAKE))
    waker.notify()  # the registry's listener
    await asyncio.wait_for(held, 5)
    assert fleet.woken == []


async def test_a_replica_that_registers_asleep_is_woken() -> None:
    fleet = Fleet()
    waker = fleet.waker_for("zero-asleep", idle=IdleSpec(min_replicas=0))
    held = asyncio.create_task(waker.hold())
    await _until(lambda: waker.held == 1)
    fleet.replicas.append(_replica("new:1", ModelState.ASLEEP))
    waker.notify()
    await asyncio.wait_for(held, 5)
    assert fleet.woken == ["new:1"]


async def test_no_replica_and_min_replicas_above_zero_is_not_held() -> None:
    fleet = Fleet(_replica("a:1", ModelState.AWAKE, healthy=False))
    waker = fleet.waker_for("down")
    await waker.hold()  # returns at once: the request path refuses as before
    assert waker.held == 0


async def test_the_sweeper_sleeps_only_beyond_min_replicas_and_only_after_idle_after_s() -> None:
    now = [100.0]
    replicas = [_replica(f"r:{i}", ModelState.AWAKE) for i in range(3)]
    fleet = Fleet(*replicas)
    waker = fleet.waker_for("idle", idle=IdleSpec(min_replicas=1, idle_after_s=30), clock=lambda: now[0])
    now[0] += 29
    waker.sweep()
    await asyncio.sleep(0)
    assert fleet.slept == []  # not idle long enough
    now[0] += 2
    replicas[2].in_flight = 1
    waker.sweep()
    await asyncio.sleep(0)
    assert fleet.slept == []  # a turn in flight
    replicas[2].in_flight = 0
    waker.sweep()
    await _until(lambda: len(fleet.slept) == 2)
    assert sorted(fleet.slept) == ["r:1", "r:2"]  # one stays awake
    assert version_state(fleet.replicas) == "awake"
    waker.sweep()
    await asyncio.sleep(0)
    assert len(fleet.slept) == 2  # asleep ones are not asked again


async def test_the_sweeper_with_min_replicas_zero_sleeps_all_and_a_request_resets_the_clock() -> None:
    now = [0.0]
    replicas = [_replica("r:1", ModelState.AWAKE)]
    fleet = Fleet(*replicas)
    waker = fleet.waker_for("zero-idle", idle=IdleSpec(min_replicas=0, idle_after_s=5), clock=lambda: now[0])
    now[0] = 4
    waker.touch()
    now[0] = 8
    waker.sweep()
    await asyncio.sleep(0)
    assert fleet.slept == []
    now[0] = 10
    waker.sweep()
    await _until(lambda: fleet.slept == ["r:1"])
    assert version_state(fleet.replicas) == "asleep"


async def test_a_busy_replica_is_asked_again_later() -> None:
    fleet = Fleet(_replica("r:1", ModelState.AWAKE))
    fleet.busy.add("r:1")
    now = [0.0]
    waker = fleet.waker_for("busy", idle=IdleSpec(min_replicas=0, idle_after_s=1), clock=lambda: now[0])
    now[0] = 2
    waker.sweep()
    await asyncio.sleep(0)
    assert fleet.slept == []
    fleet.busy.clear()
    waker.sweep()
    await asyncio.sleep(0)
    assert fleet.slept == []  # not asked again on every sweep
    now[0] += SLEEP_RETRY_S
    waker.sweep()
    await _until(lambda: fleet.slept == ["r:1"])


async def test_no_idle_after_s_never_sleeps() -> None:
    fleet = Fleet(_replica("r:1", ModelState.AWAKE), _replica("r:2", ModelState.AWAKE))
    now = [0.0]
    waker = fleet.waker_for("never", idle=IdleSpec(min_replicas=0), clock=lambda: now[0])
    now[0] = 1e6
    waker.sweep()
    await asyncio.sleep(0)
    assert fleet.slept == []


def test_version_state() -> None:
    assert version_state([]) == "stopped"
    assert version_state([_replica("a", ModelState.AWAKE, healthy=False)]) == "stopped"
    assert version_state([_replica("a", ModelState.ASLEEP), _replica("b", ModelState.WAKING)]) == "waking"
    assert version_state([_replica("a", ModelState.FALLING_ASLEEP)]) == "asleep"
    assert version_state([_replica("a", ModelState.ASLEEP), _replica("b", ModelState.AWAKE)]) == "awake"


async def test_work_another_router_sends_keeps_the_version_awake() -> None:
    now = [0.0]
    replica = _replica("r:1", ModelState.AWAKE)
    fleet = Fleet(replica)
    waker = fleet.waker_for("shared", idle=IdleSpec(min_replicas=0, idle_after_s=5), clock=lambda: now[0])
    waker.sweep()
    now[0] = 6
    replica.report = replace(replica.report, prompt_tokens_total=40)  # another router's turn ran there
    waker.sweep()
    await asyncio.sleep(0)
    assert fleet.slept == [] and waker.last_request == 6
    now[0] = 12
    waker.sweep()
    await _until(lambda: fleet.slept == ["r:1"])
