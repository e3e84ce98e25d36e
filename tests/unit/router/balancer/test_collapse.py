from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

import pytest

from services.router.balancer.collapse import Collapser


async def _consume(c: Collapser[int], key: str, make) -> list[tuple[int, bool]]:  # type: ignore[no-untyped-def]
    async with aclosing(c.run(key, make)) as events:
        return [e async for e in events]


async def test_concurrent_waiters_share_one_computation_and_see_every_event() -> None:
    c: Collapser[int] = Collapser()
    calls = 0
    gate = asyncio.Event()

    async def compute() -> AsyncGenerator[int, None]:
        nonlocal calls
        calls += 1
        yield 1
        await gate.wait()
        yield 2
        yield 3

    first = asyncio.create_task(_consume(c, "k", compute))
    await asyncio.sleep(0.01)  # the first event is out before the others join
    others = [asyncio.create_task(_consume(c, "k", compute)) for _ in range(3)]
    await asyncio.sleep(0.01)
    gate.set()
    results = await asyncio.gather(first, *others)
    assert calls == 1
    assert [e for e, _ in results[0]] == [1, 2, 3] and not any(j for _, j in results[0])
    for r in results[1:]:
        assert r == [(1, True), (2, True), (3, True)]
    assert c.in_flight() == 0
    await _consume(c, "k", compute)  # finished keys are forgotten: a later request computes again
    assert calls == 2


async def test_errors_reach_every_waiter() -> None:
    c: Collapser[int] = Collapser()

    async def boom() -> AsyncGenerator[int, None]:
        yield 1
        await asyncio.sleep(0.01)
        raise RuntimeError("worker failed")

    results = await asyncio.gather(*(_consume(c, "k", boom) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)


async def test_computation_is_cancelled_only_when_every_waiter_left() -> None:
    c: Collapser[int] = Collapser()
    stopped = asyncio.Event()

    async def forever() -> AsyncGenerator[int, None]:
        try:
            while True:
                yield 0
                await asyncio.sleep(0.005)
        finally:
            stopped.set()

    a = asyncio.create_task(_consume(c, "k", forever))
    b = asyncio.create_task(_consume(c, "k", forever))
    await asyncio.sleep(0.02)
    a.cancel()
    await asyncio.sleep(0.02)
    assert not stopped.is_set(), "one waiter leaving must not stop the others' stream"
    b.cancel()
    await asyncio.wait_for(stopped.wait(), 2)
    with pytest.raises(asyncio.CancelledError):
        await b
