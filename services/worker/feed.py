"""A queue from a sequence's thread to the event loop that wakes the loop only when its reader waits.

``asyncio.Queue`` fed through ``call_soon_threadsafe`` wakes the loop once per token. While the
reader is busy elsewhere (writing the last frame, or holding one for the flush window,
services/common/coalesce.py) those wake-ups buy nothing: the tokens are merged into the next frame
anyway. :class:`Feed` appends under a lock and calls into the loop only when the reader is parked
in :meth:`Feed.get`, so a held stream costs its producer thread an append per token, not a loop pass.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Feed(Generic[T]):
    """One producer thread, one reader on ``loop``. ``put`` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: deque[T] = deque()  # named like asyncio.Queue's, so readers may peek the same way
        self._lock = threading.Lock()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: T) -> None:
        """Append; wake the reader only if it is waiting. RuntimeError if the loop is closed."""
        with self._lock:
            self._queue.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_release, waiter)

    def empty(self) -> bool:
        return not self._queue

    def get_nowait(self) -> T:
        """The oldest item; asyncio.QueueEmpty when there is none."""
        try:
            return self._queue.popleft()
        except IndexError:
            raise asyncio.QueueEmpty from None

    async def get(self) -> T:
        """The oldest item, waiting for one (cancellable)."""
        while True:
            with self._lock:
                if self._queue:
                    return self._queue.popleft()
                waiter: asyncio.Future[None] = self._loop.create_future()
                self._waiter = waiter
            try:
                await waiter
            finally:
                with self._lock:
                    if self._waiter is waiter:
                        self._waiter = None
