"""Chat sessions: held sequences are bounded by count (LRU) and idle time, and freed with the stream."""

from __future__ import annotations

from services.worker.sessions import ChatSessions


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _pool(max_open: int, idle_s: float, clock: Clock | None = None) -> tuple[ChatSessions, list[int]]:
    freed: list[int] = []
    if clock is None:
        return ChatSessions(max_open, idle_s, freed.append), freed
    return ChatSessions(max_open, idle_s, freed.append, now=clock), freed


def test_take_returns_what_keep_held() -> None:
    pool, freed = _pool(4, 60.0)
    session = pool.open()
    session.keep(7)
    assert pool.held == 1
    assert session.take() == 7 and pool.held == 0
    assert session.take() is None
    assert freed == []


def test_least_recently_used_is_freed_beyond_max_open() -> None:
    clock = Clock()
    pool, freed = _pool(2, 60.0, clock)
    sessions = [pool.open() for _ in range(3)]
    for i, session in enumerate(sessions):
        clock.t = i
        session.keep(10 + i)
    assert pool.held == 2 and freed == [10]
    assert sessions[0].take() is None  # its next turn starts fresh
    assert pool.evicted_total == 1


def test_idle_sequences_are_swept() -> None:
    clock = Clock()
    pool, freed = _pool(8, 10.0, clock)
    old, new = pool.open(), pool.open()
    old.keep(1)
    clock.t = 8.0
    new.keep(2)
    clock.t = 12.0
    assert pool.sweep() == 1
    assert freed == [1] and pool.held == 1


def test_closed_session_frees_held_and_late_sequences() -> None:
    pool, freed = _pool(8, 60.0)
    session = pool.open()
    session.keep(1)
    session.close()
    assert freed == [1] and pool.held == 0
    session.keep(2)  # a turn that was still finishing when the stream ended
    assert freed == [1, 2] and pool.held == 0


def test_max_open_zero_keeps_nothing() -> None:
    pool, freed = _pool(0, 60.0)
    pool.open().keep(3)
    assert freed == [3] and pool.held == 0
