"""Chat sessions: held sequences are bounded by count (LRU) and idle time, and freed with the stream."""

from __future__ import annotations

from services.worker.sessions import ChatSessions


class Seq:
    def __init__(self) -> None:
        self.closed = False

    def step(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_take_returns_what_keep_held() -> None:
    pool = ChatSessions(4, 60.0)
    session = pool.open()
    seq = Seq()
    session.keep(seq)
    assert pool.held == 1
    assert session.take() is seq and pool.held == 0
    assert session.take() is None
    assert not seq.closed


def test_least_recently_used_is_freed_beyond_max_open() -> None:
    clock = Clock()
    pool = ChatSessions(2, 60.0, now=clock)
    sessions = [pool.open() for _ in range(3)]
    seqs = [Seq() for _ in range(3)]
    for i, (session, seq) in enumerate(zip(sessions, seqs, strict=True)):
        clock.t = i
        session.keep(seq)
    assert pool.held == 2 and seqs[0].closed and not seqs[1].closed and not seqs[2].closed
    assert sessions[0].take() is None  # its next turn starts fresh
    assert pool.evicted_total == 1


def test_idle_sequences_are_swept() -> None:
    clock = Clock()
    pool = ChatSessions(8, 10.0, now=clock)
    old, new = pool.open(), pool.open()
    old_seq, new_seq = Seq(), Seq()
    old.keep(old_seq)
    clock.t = 8.0
    new.keep(new_seq)
    clock.t = 12.0
    assert pool.sweep() == 1
    assert old_seq.closed and not new_seq.closed and pool.held == 1


def test_closed_session_frees_held_and_late_sequences() -> None:
    pool = ChatSessions(8, 60.0)
    session = pool.open()
    held = Seq()
    session.keep(held)
    session.close()
    assert held.closed and pool.held == 0
    late = Seq()  # a turn that was still finishing when the stream ended
    session.keep(late)
    assert late.closed and pool.held == 0


def test_max_open_zero_keeps_nothing() -> None:
    pool = ChatSessions(0, 60.0)
    seq = Seq()
    pool.open().keep(seq)
    assert seq.closed and pool.held == 0
