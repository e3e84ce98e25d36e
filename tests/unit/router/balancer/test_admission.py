from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ResourceExhausted
from services.router.balancer.slo_queue import Admission
from services.router.balancer.tiers import TierName

E = TierName.EDGE


async def test_waiters_are_released_fairly_when_slots_free() -> None:
    adm = Admission(lambda t: 1, default_slo_ms=0)
    held = await adm.acquire(E, tenant="heavy", priority=0, cost=100, uncached_tokens=0)
    order: list[str] = []

    async def one(tenant: str, cost: int) -> None:
        ticket = await adm.acquire(E, tenant=tenant, priority=0, cost=cost, uncached_tokens=0)
        order.append(tenant)
        adm.release(ticket)

    tasks = [asyncio.create_task(one("heavy", 1000)) for _ in range(5)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("light", 10)))
    await asyncio.sleep(0)
    assert adm.saturated(E)
    adm.release(held)
    await asyncio.gather(*tasks)
    assert order.index("light") <= 1


async def test_shed_when_the_estimate_exceeds_the_tenant_slo() -> None:
    adm = Admission(lambda t: 2, default_slo_ms=0, tenant_slo_ms={"strict": 1000}, turn_s=2.0)
    tickets = [await adm.acquire(E, tenant="x", priority=0, cost=1, uncached_tokens=0) for _ in range(2)]
    assert adm.estimate_ttft_s(E, 0, 0) == pytest.approx(1.0)  # (0 ahead + 1) * 2 s / 2 slots
    with pytest.raises(ResourceExhausted) as err:
        await adm.acquire(E, tenant="strict", priority=0, cost=1, uncached_tokens=1000)
    assert err.value.retry_after_ms >= 100
    # A tenant without an SLO waits instead, and gets the slot when one frees.
    waiting = asyncio.create_task(adm.acquire(E, tenant="x", priority=0, cost=1, uncached_tokens=0))
    await asyncio.sleep(0)
    assert not waiting.done()
    adm.release(tickets[0], held_s=4.0)
    ticket = await waiting
    assert adm.turn_s == pytest.approx(2.4)  # EWMA of held time
    adm.release(ticket)
    adm.release(ticket)  # idempotent


async def test_cancelled_waiter_leaves_the_queue() -> None:
    adm = Admission(lambda t: 1)
    held = await adm.acquire(E, tenant="a", priority=0, cost=1, uncached_tokens=0)
    waiting = asyncio.create_task(adm.acquire(E, tenant="b", priority=0, cost=1, uncached_tokens=0))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    adm.release(held)
    assert not adm.saturated(E)
