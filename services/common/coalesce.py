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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


async def coalesced(
    source: AsyncIterator[T], merge: Callable[[T, T], T | None], *, inline: int = 3
) -> AsyncGenerator[T, None]:
    """The frames of ``source``, those that waited for the writer merged by ``merge`` (see module doc)."""
    frames = aiter(source)
    try:
        for _ in range(inline):
            try:
                first = await anext(frames)
            except StopAsyncIteration:
                return
            yield first
    except BaseException:
        await _close(source)
        raise
    loop = asyncio.get_running_loop()
    waiting: deque[T] = deque()
    wake: list[asyncio.Future[None]] = []  # the writer's wake-up while it waits for a frame
    ended: list[BaseException | None] = []  # one entry once ``source`` has ended: its error or None

    def notify() -> None:
        if wake and not wake[0].done():
            wake[0].set_result(None)

    async def pump() -> None:
        error: BaseException | None = None
        try:
            async for frame in frames:
                waiting.append(frame)
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
            yield frame
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        await _close(source)


async def _close(source: AsyncIterator[T]) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
