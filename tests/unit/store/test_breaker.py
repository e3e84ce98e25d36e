"""Circuit breaker state machine on a fake clock."""

from __future__ import annotations

from services.store.breaker import CircuitBreaker, State


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_and_probes_once() -> None:
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, reset_s=1.0, max_reset_s=3.0, clock=clock)
    assert b.allow()
    b.failure()
    assert b.state is State.CLOSED and b.allow()
    b.failure()
    assert b.state is State.OPEN and not b.allow() and b.opened == 1
    clock.now = 1.0
    assert b.allow()  # the probe
    assert not b.allow()  # only one probe at a time
    b.failure()  # probe failed: open twice as long
    clock.now = 2.5
    assert not b.allow()
    clock.now = 3.0
    assert b.allow()
    b.success()
    assert b.state is State.CLOSED and b.allow() and b.failures == 0


def test_backoff_is_capped() -> None:
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, reset_s=1.0, max_reset_s=2.0, clock=clock)
    for _ in range(5):
        b.failure()
        clock.now += 2.0
        assert b.allow()
    assert b.state is State.HALF_OPEN
