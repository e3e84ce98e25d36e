"""Feed: items from a thread reach the loop's reader in order, and the loop is woken only while the
reader waits."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.worker.feed import Feed


class _CountingLoop:
    """Counts call_soon_threadsafe on the real running loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wakeups = 0

    def call_soon_threadsafe(self, *args: object) -> object:
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(*args)  # type: ignore[arg-type]

    def create_future(self) -> asyncio.Future[None]:
        return self.loop.create_future()


async def test_items_put_while_the_reader_is_busy_wake_nothing_and_arrive_in_order() -> None:
    counting = _CountingLoop(asyncio.get_running_loop())
    feed: Feed[int] = Feed(counting)  # type: ignore[arg-type]
    producer = threading.Thread(target=lambda: [feed.put(i) for i in range(100)])
    producer.start()
    producer.join()
    assert counting.wakeups == 0
    assert [await feed.get() for _ in range(100)] == list(range(100))
    assert feed.empty()
    with pytest.raises(asyncio.QueueEmpty):
        feed.get_nowait()


async def test_a_waiting_reader_is_woken_once_per_wait_by_a_thread() -> None:
    counting = _CountingLoop(asyncio.get_running_loop())
    feed: Feed[str] = Feed(counting)  # type: ignore[arg-type]
    got = asyncio.ensure_future(feed.get())
    await asyncio.sleep(0)  # the reader parks
    producer = threading.Thread(target=lambda: (feed.put("a"), feed.put("b")))
    producer.start()
    assert await asyncio.wait_for(got, 5) == "a"
    await asyncio.to_thread(producer.join, 5)  # "b" may still be on its way
    assert counting.wakeups == 1, "only the put that found the reader waiting wakes the loop"
    assert feed.get_nowait() == "b"


async def test_a_cancelled_get_leaves_no_waiter_behind() -> None:
    counting = _CountingLoop(asyncio.get_running_loop())
    feed: Feed[int] = Feed(counting)  # type: ignore[arg-type]
    got = asyncio.ensure_future(feed.get())
    await asyncio.sleep(0)
    got.cancel()
    with pytest.raises(asyncio.CancelledError):
        await got
    feed.put(7)  # nobody waits: no wake-up, the item stays for the next get
    assert counting.wakeups == 0
    assert await asyncio.wait_for(feed.get(), 5) == 7


async def test_many_producer_threads_and_one_reader_lose_and_duplicate_nothing() -> None:
    feed: Feed[int] = Feed(asyncio.get_running_loop())
    threads = [threading.Thread(target=lambda k=k: [feed.put(k * 1000 + i) for i in range(500)]) for k in range(4)]
    for t in threads:
        t.start()
    got = [await asyncio.wait_for(feed.get(), 5) for _ in range(2000)]
    for t in threads:
        t.join()
    assert sorted(got) == sorted(k * 1000 + i for k in range(4) for i in range(500))
    for k in range(4):  # each producer's items keep their order
        mine = [x for x in got if x // 1000 == k]
        assert mine == sorted(mine)
