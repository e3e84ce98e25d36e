"""Write-side coalescing of a relayed stream: frames that arrived while the previous one was being
written are merged into one, so a hop that falls behind its upstream sends fewer, larger frames.

:func:`coalesced` reads ``source`` in a task of its own and yields to the writer; each time the
writer comes back for more, everything that arrived meanwhile and ``merge`` accepts is folded into
the first waiting frame. It never waits to merge: a frame that is alone is yielded at once (the
first token keeps its latency). ``merge(first, then)`` returns the one frame standing for both (it
may be ``first`` changed in place), or None, changing nothing, when the two must stay apart: a
final, usage, route or error frame, or a frame of another turn.

The first ``inline`` frames are read in the writer's own task, one after the other, and the
reading task starts only after them: a short stream (a cache hit, a few frames an upstream already
merged) costs no task and no extra wake-ups, which measurably cost more CPU than they save there
(docs/benchmarks/hops.md).

Errors of ``source`` reach the writer after the frames read before them; closing the generator
(the caller went away) cancels the reading task and waits for it, so ``source``'s own cleanup
(cancelling the upstream call, settling) runs before this returns.

**Flush window** (:class:`FlushWindow`, vLLM's stream interval made adaptive): while the process is
busy (at least ``busy_streams`` streams open through it), a stream's token frames go out at least
``window_s`` apart; tokens that arrive meanwhile are merged into the held frame. The first frame of
a stream is never held, nor a frame ``urgent`` says must go at once (a final, usage or error frame:
it also flushes the held frame at once), nor anything once ``source`` has ended or failed. A lone
stream (or any stream while the process is not busy) is never held. The worker runtime applies the
same policy to its token queue (:mod:`services.worker.runner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


class FlushWindow:
    """One process's flush-window policy and its count of open streams (see module doc).

    ``window_s`` 0 turns it off. ``clock`` must be the event loop's clock (``time.monotonic``)
    unless only :meth:`hold_s` is used (a fake clock in tests).
    """

    def __init__(
        self, window_s: float = 0.0, busy_streams: int = 8, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_s < 0 or busy_streams < 1:
            raise ValueError("the flush window must be >= 0 s and the busy threshold >= 1 stream")
        self.window_s = window_s
        self.busy_streams = busy_streams
        self.clock = clock
        self.active = 0  # streams open through this process (counted by coalesced() and the worker runtime)

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    @property
    def busy(self) -> bool:
        """Whether frames are held now: the window is on and enough streams are open."""
        return self.window_s > 0 and self.active >= self.busy_streams

    def hold_s(self, last_sent: float | None) -> float:
        """Seconds to hold a token frame whose stream last sent a frame at ``last_sent`` (None: none yet)."""
        if last_sent is None or not self.busy:
            return 0.0
        return max(0.0, last_sent + self.window_s - self.clock())


def coalesced(
    source: AsyncIterator[T],
    merge: Callable[[T, T], T | None],
    *,
    inline: int = 3,
    window: FlushWindow | None = None,
    urgent: Callable[[T], bool] | None = None,
) -> AsyncGenerator[T, None]:
    """The frames of ``source``, those that waited for the writer merged by ``merge`` (see module doc).

    With a ``window`` that is on, the stream counts as open in it and token frames are spaced by it
    while the process is busy; ``urgent`` (required then) names the frames never held (finals, errors).
    """
    if window is not None and not window.enabled:
        window = None
    if window is not None and urgent is None:
        raise ValueError("a flush window needs `urgent` (which frames are never held)")
    return _coalesced(source, merge, inline, window, urgent or _never)


def _never(_: object) -> bool:
    return False


async def _coalesced(
    source: AsyncIterator[T],
    merge: Callable[[T, T], T | None],
    inline: int,
    window: FlushWindow | None,
    urgent: Callable[[T], bool],
) -> AsyncGenerator[T, None]:
    if window is not None:
        window.active += 1
    try:
        frames = aiter(source)
        last_sent: float | None = None
        try:
            for i in range(inline):
                if i and window is not None and window.busy:
                    break  # frames after the first are held: the reading task merges what comes meanwhile
                try:
                    first = await anext(frames)
                except StopAsyncIteration:
                    return
                if window is not None:
                    last_sent = window.clock()
                yield first
        except BaseException:
            await _close(source)
            raise
        loop = asyncio.get_running_loop()
        waiting: deque[T] = deque()
        wake: list[asyncio.Future[None]] = []  # the writer's wake-up while it waits for a frame
        ended: list[BaseException | None] = []  # one entry once ``source`` has ended: its error or None
        holding: list[bool] = [False]  # the writer holds a frame: only an urgent frame or the end wakes it

        def notify() -> None:
            if wake and not wake[0].done():
                wake[0].set_result(None)

        async def pump() -> None:
            error: BaseException | None = None
            try:
                async for frame in frames:
                    waiting.append(frame)
                    if not holding[0] or urgent(frame):
                        notify()
            except BaseException as exc:  # handed to the writer, raised there after the frames before it
                error = exc
                if isinstance(exc, asyncio.CancelledError):
                    raise
            finally:
                ended.append(error)
                notify()

        reader = asyncio.create_task(pump())
        try:
            while True:
                if not waiting:
                    if ended:
                        if ended[0] is not None:
                            raise ended[0]
                        return
                    wake[:] = [loop.create_future()]
                    await wake[0]
                    continue
                frame = waiting.popleft()
                while waiting and (merged := merge(frame, waiting[0])) is not None:
                    frame = merged
                    waiting.popleft()
                if window is not None:
                    # Held until the window has passed since the last frame, unless something that
                    # cannot wait (a final, an error, the end) comes first; arrivals merge meanwhile
                    # (without waking the writer one by one).
                    while not (ended or urgent(frame)) and (hold := window.hold_s(last_sent)) > 0:
                        if any(map(urgent, waiting)):
                            break
                        wake[:] = [loop.create_future()]
                        timer = loop.call_later(hold, notify)
                        holding[0] = True
                        try:
                            await wake[0]
                        finally:
                            holding[0] = False
                            timer.cancel()
                    while waiting and (merged := merge(frame, waiting[0])) is not None:
                        frame = merged
                        waiting.popleft()
                    last_sent = window.clock()
                yield frame
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            await _close(source)
    finally:
        if window is not None:
            window.active -= 1


async def _close(source: AsyncIterator[T]) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
