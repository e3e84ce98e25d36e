"""Circuit breaker around Redis: an outage costs a few timeouts, not one per request.

closed --(``failure_threshold`` consecutive failures)--> open --(``reset_s`` elapsed)--> half-open:
exactly one caller is let through as a probe; its success closes the breaker, its failure opens it
again for twice as long (capped at ``max_reset_s``). While open, callers skip Redis (a miss).
Written here rather than taken from a library: the few breaker packages on PyPI are sync-only or
thread-locked, and this is 50 lines on a single event loop (no locks needed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum


class State(StrEnum):
    """A circuit breaker's state: CLOSED calls Redis, OPEN skips it, HALF_OPEN lets one call probe it."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    """Skips Redis after ``failure_threshold`` failures in a row, for ``reset_s`` doubling up to ``max_reset_s``."""

    failure_threshold: int = 3
    reset_s: float = 0.5
    max_reset_s: float = 5.0
    clock: object = field(default=time.monotonic, repr=False)
    state: State = State.CLOSED
    failures: int = 0
    opened: int = 0
    """How many times the breaker opened (a counter for stats and tests)."""
    _open_until: float = 0.0
    _backoff: float = 0.0
    _probing: bool = False

    def _now(self) -> float:
        return self.clock()  # type: ignore[operator,no-any-return]

    def allow(self) -> bool:
        """May the caller use Redis now? In half-open state only one probe at a time is allowed."""
        if self.state is State.CLOSED:
            return True
        if self.state is State.OPEN and self._now() >= self._open_until:
            self.state = State.HALF_OPEN
            self._probing = False
        if self.state is State.HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    def abandon(self) -> None:
        """The caller let through gave no answer (it was cancelled): the next caller may probe."""
        self._probing = False

    def success(self) -> None:
        self.state = State.CLOSED
        self.failures = 0
        self._backoff = 0.0
        self._probing = False

    def failure(self) -> None:
        self.failures += 1
        if self.state is State.HALF_OPEN or self.failures >= self.failure_threshold:
            self._backoff = min(self.max_reset_s, self._backoff * 2 if self._backoff else self.reset_s)
            self._open_until = self._now() + self._backoff
            if self.state is not State.OPEN:
                self.opened += 1
            self.state = State.OPEN
            self._probing = False
