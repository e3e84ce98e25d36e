"""Chat sessions: an engine sequence kept between the turns of one Worker stream.

A stream's :class:`ChatSession` names the sequence its last turn left held in the engine (its KV
kept: ``NewSequence.hold``) while no turn runs, so the next turn reuses it and prefills only its new
tokens (the engine decides how much it can reuse). :class:`ChatSessions` bounds what is held: at most
``max_open`` idle sequences (the least recently used is freed first), and a sequence idle for
``idle_timeout_s`` is freed by ``sweep()``; freeing one calls ``release`` with its id (the runner
stops it in the engine). A freed session still works: its next turn starts a fresh sequence and
prefills the whole context. Event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class HeldPrefix:
    """Tokens whose KV a sequence holds, and the scope their block hashes are salted with."""

    token_ids: tuple[int, ...]
    tenant: str = ""
    shareable: bool = False


class ChatSession:
    """The held sequence of one stream. ``take`` before a turn, ``keep`` after it, ``close`` at the end."""

    def __init__(self, pool: ChatSessions) -> None:
        self._pool = pool
        self.seq: int | None = None
        self.closed = False
        self.last_used = pool.now()
        self.held: HeldPrefix | None = None
        """Tokens whose KV the held sequence holds, and their scope (for the load report)."""

    def take(self) -> int | None:
        """The held sequence's id (now owned by the caller), or None."""
        return self._pool.take(self)

    def keep(self, seq: int, held: HeldPrefix | None = None) -> None:
        """Hold sequence ``seq`` for the next turn (may free the least recently used held sequence).

        ``held``: the tokens ``seq`` holds KV for, reported as hot prefix blocks while it is held.
        """
        self.held = held
        self._pool.keep(self, seq)

    def close(self) -> None:
        """Free the held sequence; the stream is gone (a turn still finishing frees its own)."""
        self.closed = True
        seq = self._pool.take(self)
        if seq is not None:
            self._pool.release(seq)


class ChatSessions:
    """The bound on held chat sequences: count (LRU eviction) and idle time."""

    def __init__(
        self,
        max_open: int,
        idle_timeout_s: float,
        release: Callable[[int], None],
        *,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_open = max_open
        self.idle_timeout_s = idle_timeout_s
        self.release = release
        """Frees a held sequence in the engine (its id)."""
        self.now = now
        self._held: OrderedDict[int, ChatSession] = OrderedDict()
        self.evicted_total = 0

    def open(self) -> ChatSession:
        return ChatSession(self)

    @property
    def held(self) -> int:
        """Sequences held between turns right now."""
        return len(self._held)

    def held_prefixes(self) -> list[HeldPrefix]:
        """What the held sequences hold, most recently used first."""
        return [s.held for s in reversed(self._held.values()) if s.held is not None and s.seq is not None]

    def take(self, session: ChatSession) -> int | None:
        self._held.pop(id(session), None)
        seq, session.seq = session.seq, None
        session.last_used = self.now()
        return seq

    def keep(self, session: ChatSession, seq: int) -> None:
        if self.max_open <= 0 or session.closed:
            self.release(seq)
            return
        session.seq = seq
        session.last_used = self.now()
        self._held[id(session)] = session
        self._held.move_to_end(id(session))
        while len(self._held) > self.max_open:
            _, old = self._held.popitem(last=False)
            if old.seq is not None:
                self.release(old.seq)
                old.seq = None
            self.evicted_total += 1

    def clear(self) -> int:
        """Free every held sequence (the model goes to sleep); returns how many were freed. Their
        sessions still work: their next turns prefill the whole context."""
        freed = 0
        while self._held:
            _, session = self._held.popitem(last=False)
            if session.seq is not None:
                self.release(session.seq)
                session.seq = None
                freed += 1
        return freed

    def sweep(self) -> int:
        """Free sequences idle longer than ``idle_timeout_s``; returns how many were freed."""
        deadline = self.now() - self.idle_timeout_s
        freed = 0
        for key, session in list(self._held.items()):
            if session.last_used > deadline:
                break  # ordered by last use
            del self._held[key]
            if session.seq is not None:
                self.release(session.seq)
                session.seq = None
                freed += 1
            self.evicted_total += 1
        return freed
