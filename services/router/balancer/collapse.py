"""Request collapsing: identical concurrent deterministic requests are computed once.

The first request for a key (the *leader*) starts the computation in a task of its own; requests
arriving with the same key while it runs (*followers*) replay the events produced so far and then
receive the rest as they come, so every waiter sees the complete stream. The computation belongs to
no single caller: it is cancelled (which aborts its worker stream) only when every waiter has left.
An error ends the stream of every waiter with that error. Once the computation ends its key is
forgotten; a later identical request is served by the response cache or computed again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Generic, TypeVar

E = TypeVar("E")


@dataclass(eq=False)
class _Flight(Generic[E]):
    events: list[E] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False
    error: BaseException | None = None
    waiters: int = 0
    task: asyncio.Task[None] | None = None


class Collapser(Generic[E]):
    """One in-flight computation per key, shared by every concurrent waiter."""

    def __init__(self) -> None:
        self._flights: dict[str, _Flight[E]] = {}

    def in_flight(self) -> int:
        return len(self._flights)

    async def run(self, key: str, make: Callable[[], AsyncGenerator[E, None]]) -> AsyncGenerator[tuple[E, bool], None]:
        """Events of the computation for ``key`` as ``(event, collapsed)``; ``collapsed`` is True
        for a waiter that joined a computation already running (``make`` is not called then)."""
        flight = self._flights.get(key)
        joined = flight is not None
        if flight is None:
            flight = _Flight()
            self._flights[key] = flight
            flight.task = asyncio.create_task(self._drive(key, flight, make()), name="router-collapsed-turn")
        flight.waiters += 1
        seen = 0
        try:
            while True:
                while seen < len(flight.events):
                    seen += 1
                    yield flight.events[seen - 1], joined
                if flight.done:
                    if flight.error is not None:
                        raise flight.error
                    return
                flight.changed.clear()
                await flight.changed.wait()
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.done and flight.task is not None:
                # Nobody listens any more: stop the computation (its worker stream is aborted).
                self._forget(key, flight)
                flight.task.cancel()

    async def _drive(self, key: str, flight: _Flight[E], events: AsyncGenerator[E, None]) -> None:
        try:
            async with aclosing(events) as stream:
                async for event in stream:
                    flight.events.append(event)
                    flight.changed.set()
        except asyncio.CancelledError:
            flight.error = asyncio.CancelledError()
        except Exception as exc:  # handed to every waiter, raised there
            flight.error = exc
        finally:
            flight.done = True
            flight.changed.set()
            self._forget(key, flight)

    def _forget(self, key: str, flight: _Flight[E]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]

    async def aclose(self) -> None:
        """Cancel every computation still running (shutdown)."""
        tasks = [f.task for f in self._flights.values() if f.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
