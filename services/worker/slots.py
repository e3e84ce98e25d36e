"""Admission control: at most ``max_active`` sequences generate; up to ``max_queue`` wait, FIFO."""

from __future__ import annotations

import asyncio
from collections import deque

from services.common.errors import ResourceExhausted


class Admission:
    """Slots for generating sequences. Used only from the event loop."""

    def __init__(self, max_active: int, max_queue: int) -> None:
        self.max_active = max_active
        self.max_queue = max_queue
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def ensure_room(self) -> None:
        """Raise ResourceExhausted if a new request could neither run nor wait."""
        if self.active >= self.max_active and self.queued >= self.max_queue:
            raise ResourceExhausted(
                f"worker is at capacity ({self.active} generating, {self.queued} queued); "
                "retry shortly or use another replica",
                retry_after_ms=500,
            )

    def try_acquire(self) -> bool:
        """Take a free slot now if one is free and nobody waits for it."""
        if self.active < self.max_active and not self.queued:
            self.active += 1
            return True
        return False

    async def acquire(self, cancelled: asyncio.Event) -> bool:
        """Wait for a slot. False if ``cancelled`` was set first; ResourceExhausted if the queue is full."""
        if self.try_acquire():
            return True
        self.ensure_room()
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        cancel_wait = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait((slot, cancel_wait), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled while queued
            self._abandon(slot)
            raise
        finally:
            cancel_wait.cancel()
        if cancelled.is_set():
            self._abandon(slot)
            return False
        return True

    def _abandon(self, slot: asyncio.Future[None]) -> None:
        if slot.done() and not slot.cancelled():
            self.release()  # granted just as we gave up: pass it on
        else:
            slot.cancel()
            self._waiters.remove(slot)

    def release(self) -> None:
        """Hand the slot to the next waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1
