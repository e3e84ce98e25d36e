from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ResourceExhausted
from services.worker.slots import Admission


async def test_slots_queue_and_handoff() -> None:
    adm = Admission(max_active=1, max_queue=1)
    never = asyncio.Event()
    assert await adm.acquire(never)
    waiter = asyncio.create_task(adm.acquire(never))
    await asyncio.sleep(0)
    assert (adm.active, adm.queued) == (1, 1)
    with pytest.raises(ResourceExhausted) as info:
        await adm.acquire(never)
    assert info.value.retry_after_ms > 0
    adm.release()
    assert await waiter
    assert (adm.active, adm.queued) == (1, 0)
    adm.release()
    assert adm.active == 0


async def test_cancel_while_queued_leaves_the_queue() -> None:
    adm = Admission(max_active=1, max_queue=2)
    assert await adm.acquire(asyncio.Event())
    cancel = asyncio.Event()
    waiter = asyncio.create_task(adm.acquire(cancel))
    await asyncio.sleep(0)
    cancel.set()
    assert await waiter is False
    assert adm.queued == 0
    adm.release()
    assert adm.active == 0


async def test_task_cancelled_while_queued_does_not_leak_a_slot() -> None:
    adm = Admission(max_active=1, max_queue=2)
    assert await adm.acquire(asyncio.Event())
    waiter = asyncio.create_task(adm.acquire(asyncio.Event()))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    adm.release()
    assert (adm.active, adm.queued) == (0, 0)
