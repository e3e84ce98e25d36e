"""Chat sessions: an engine sequence kept between the turns of one Worker stream.

A stream's :class:`ChatSession` holds its sequence (and so its KV) while no turn runs, so the next
turn prefills only its new tokens (the engine decides how much it can reuse). :class:`ChatSessions`
bounds what is held: at most ``max_open`` idle sequences (the least recently used is freed first),
and a sequence idle for ``idle_timeout_s`` is freed by ``sweep()``. A freed session still works: its
next turn starts a fresh sequence and prefills the whole context.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.worker.types import EngineSequence


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
        self.seq: EngineSequence | None = None
        self.closed = False
        self.last_used = pool.now()
        self.held: HeldPrefix | None = None
        """Tokens whose KV the held sequence holds, and their scope (for the load report)."""

    def take(self) -> EngineSequence | None:
        """The held sequence (now owned by the caller), or None."""
        return self._pool.take(self)

    def keep(self, seq: EngineSequence, held: HeldPrefix | None = None) -> None:
        """Hold ``seq`` for the next turn (may free the least recently used held sequence).

        ``held``: the tokens ``seq`` holds KV for, reported as hot prefix blocks while it is held.
        """
        self.held = held
        self._pool.keep(self, seq)

    def close(self) -> None:
        """Free the held sequence; the stream is gone (a turn still finishing frees its own)."""
        self.closed = True
        seq = self._pool.take(self)
        if seq is not None:
            seq.close()


class ChatSessions:
    """Thread-safe bound on held chat sequences: count (LRU eviction) and idle time."""

    def __init__(self, max_open: int, idle_timeout_s: float, *, now: Callable[[], float] = time.monotonic) -> None:
        self.max_open = max_open
        self.idle_timeout_s = idle_timeout_s
        self.now = now
        self._lock = threading.Lock()
        self._held: OrderedDict[int, ChatSession] = OrderedDict()
        self.evicted_total = 0

    def open(self) -> ChatSession:
        return ChatSession(self)

    @property
    def held(self) -> int:
        """Sequences held between turns right now."""
        with self._lock:
            return len(self._held)

    def held_prefixes(self) -> list[HeldPrefix]:
        """What the held sequences hold, most recently used first."""
        with self._lock:
            return [s.held for s in reversed(self._held.values()) if s.held is not None and s.seq is not None]

    def take(self, session: ChatSession) -> EngineSequence | None:
        with self._lock:
            self._held.pop(id(session), None)
            seq, session.seq = session.seq, None
            session.last_used = self.now()
            return seq

    def keep(self, session: ChatSession, seq: EngineSequence) -> None:
        if self.max_open <= 0 or session.closed:
            seq.close()
            return
        victims: list[EngineSequence] = []
        with self._lock:
            session.seq = seq
            session.last_used = self.now()
            self._held[id(session)] = session
            self._held.move_to_end(id(session))
            while len(self._held) > self.max_open:
                _, old = self._held.popitem(last=False)
                if old.seq is not None:
                    victims.append(old.seq)
                    old.seq = None
                self.evicted_total += 1
        for victim in victims:
            victim.close()

    def sweep(self) -> int:
        """Free sequences idle longer than ``idle_timeout_s``; returns how many were freed."""
        deadline = self.now() - self.idle_timeout_s
        victims: list[EngineSequence] = []
        with self._lock:
            for key, session in list(self._held.items()):
                if session.last_used > deadline:
                    break  # ordered by last use
                del self._held[key]
                if session.seq is not None:
                    victims.append(session.seq)
                    session.seq = None
                self.evicted_total += 1
        for victim in victims:
            victim.close()
        return len(victims)
