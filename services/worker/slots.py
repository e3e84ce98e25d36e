"""Admission control: at most ``max_active`` sequences generate; up to ``max_queue`` wait, FIFO.

A turn of n choices takes n slots at once (all or none, so two such turns cannot each hold part of
what they need and wait for each other); a waiter that needs more slots than are free holds up the
ones behind it (FIFO, no overtaking)."""

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
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for w, _ in self._waiters if not w.done())

    def ensure_room(self) -> None:
        """Raise ResourceExhausted if a new request could neither run nor wait."""
        if self.active >= self.max_active and self.queued >= self.max_queue:
            raise ResourceExhausted(
                f"worker is at capacity ({self.active} generating, {self.queued} queued); "
                "retry shortly or use another replica",
                retry_after_ms=500,
            )

    def try_acquire(self, count: int = 1) -> bool:
        """Take ``count`` free slots now if they are free and nobody waits for slots."""
        if self.active + count <= self.max_active and not self.queued:
            self.active += count
            return True
        return False

    async def acquire(self, cancelled: asyncio.Event, count: int = 1) -> bool:
        """Wait for ``count`` slots. False if ``cancelled`` was set first; ResourceExhausted if the queue
        is full. ``count`` must not exceed ``max_active``."""
        if self.try_acquire(count):
            return True
        self.ensure_room()
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((slot, count))
        cancel_wait = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait((slot, cancel_wait), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled while queued
            self._abandon(slot, count)
            raise
        finally:
            cancel_wait.cancel()
        if cancelled.is_set():
            self._abandon(slot, count)
            return False
        return True

    def _abandon(self, slot: asyncio.Future[None], count: int) -> None:
        if slot.done() and not slot.cancelled():
            self.release(count)  # granted just as we gave up: pass them on
        else:
            slot.cancel()
            self._waiters.remove((slot, count))
            self._grant()  # a large waiter leaving may let smaller ones behind it in

    def release(self, count: int = 1) -> None:
        """Free ``count`` slots, handing them to the waiters in order while their counts fit."""
        self.active -= count
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            waiter, count = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if self.active + count > self.max_active:
                return
            self._waiters.popleft()
            self.active += count
            waiter.set_result(None)
