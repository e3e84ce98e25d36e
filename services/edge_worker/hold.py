"""When background sequences (batch lines) sit out a step of the batched edge engine.

On a CPU-bound worker every batch row in a decode call, and every batch prefill chunk, takes cores
from the interactive turns beside it, on this worker and on the other workers of the same host. So
:class:`BackgroundHold` (pure: the engine loop thread passes the clock in) holds the background
sequences of a step (no prefill chunk, no decode row: they keep their KV and wait) while foreground
work is active:

* **here**: a foreground sequence is in the step, or was in one within ``idle_s`` and is not closed (a
  chat turn that just ended keeps its sequence: its next turn, or an agent's next call, often comes
  at once);
* **host**: the host's foreground flag (:attr:`BackgroundHold.host_until`) has not expired. The router
  sets it while it runs a foreground turn on any worker of this host (services/router/balancer/host_hold.py),
  renewing it while the turn runs; a flag that is not renewed (the router is gone or stopped) expires
  by itself, so it never holds a line for longer than its time to live.

A step of background sequences only that began while nothing held them is **preemptible**: when
foreground work arrives during its model call (a foreground sequence added to this engine, or the host
flag being set), the engine stops that call part-way (onnxruntime's ``RunOptions.terminate``) instead of
letting the interactive turn wait for it, and the sequences it had not finished are held; their step
runs again, whole, when the hold ends (the KV positions a stopped call wrote are written again with
the same values: batch invariance and greedy replay are unchanged).

Bounded: after ``max_hold_s`` of continuous holding one step lets the background sequences through
(never a step that prefills a foreground prompt, so an interactive first token never shares its step
with batch work), then the hold starts again. Under a foreground load that never pauses, a batch line
still advances one step per ``max_hold_s``: delayed, never starved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import structlog
from prometheus_client import Counter

log = structlog.get_logger(__name__)

HELD_ROUNDS = Counter(
    "meshserve_background_held_rounds_total",
    "Engine rounds run with the background sequences (batch lines) held out, by cause.",
    ["cause"],
)
HOLDS = Counter(
    "meshserve_background_holds_total",
    "Holds of the background sequences (batch lines) begun, by the cause that began them.",
    ["cause"],
)
HELD_SECONDS = Counter(
    "meshserve_background_held_seconds_total",
    "Seconds background sequences (batch lines) waited held out of an engine's rounds.",
)
HOLD_BOUND = Counter(
    "meshserve_background_hold_bound_total",
    "Rounds that let held background sequences through because they had waited the worker's max hold time.",
)
PREEMPTED = Counter(
    "meshserve_background_preempted_calls_total",
    "Model calls of background sequences only (batch lines) stopped part-way because foreground work "
    "arrived (they are run again, whole, once the hold ends).",
)
FOREGROUND_IDLE_S = 0.05
"""A foreground sequence that was in a step this recently (and is not closed: a chat turn's sequence
kept for its next turn) still counts as active."""


class Member(Protocol):
    """What the rule reads of a sequence (services/edge_worker/sequence.py's EdgeSequence)."""

    background: bool
    closed: bool
    kv_len: int
    prefill_end: int


M = TypeVar("M", bound=Member)


class BackgroundHold:
    """The hold rule (see the module docstring). Called from the engine loop thread only, except
    :meth:`hold_host`, which any thread may call (one float written)."""

    def __init__(self, *, max_hold_s: float, idle_s: float = FOREGROUND_IDLE_S) -> None:
        self.max_hold_s = max_hold_s
        self.idle_s = idle_s
        self.host_until = 0.0
        """The host's foreground flag holds until this time (the engine's clock; 0: not set)."""
        self._recent: dict[Member, float] = {}  # foreground sequences by when they were last in a round
        self.since: float | None = None
        """When the present hold began (None: background sequences are not being held)."""
        self.holds: dict[str, int] = {}
        """Holds begun, by the cause that began them (``here``, ``host``)."""
        self.rounds = 0
        """Rounds that ran foreground sequences with the background ones held out."""
        self.held_s = 0.0
        """Seconds of holding, over the holds that have ended."""
        self.bound_hits = 0
        """Rounds the bound let through (``max_hold_s`` of continuous holding)."""
        self.preemptions = 0
        """Model calls of background sequences only stopped part-way for foreground work."""

    def hold_host(self, until: float) -> None:
        """The host's foreground flag: hold until ``until`` (a time on the engine's clock; 0 ends it)."""
        self.host_until = until

    def cause(self, batch: Sequence[Member], now: float) -> str | None:
        """Why background sequences must sit out now: ``here``, ``host``, or None (they may run)."""
        for seq in batch:
            if not seq.background:
                self._recent[seq] = now
        if self._recent:
            self._recent = {s: t for s, t in self._recent.items() if not s.closed and now - t < self.idle_s}
        if self._recent:
            return "here"
        if now < self.host_until:
            return "host"
        return None

    def split(self, batch: list[M], now: float) -> tuple[list[M], list[M]]:
        """This round's sequences, and the background ones held out of it."""
        cause = self.cause(batch, now)  # first: it records the round's foreground sequences
        background = [s for s in batch if s.background]
        if not background or cause is None:
            self._end(now)
            return batch, []
        if self.since is None:
            self.since = now
            self.holds[cause] = self.holds.get(cause, 0) + 1
            HOLDS.labels(cause).inc()
        prefilling = any(not s.background and s.prefill_end - s.kv_len >= 2 for s in batch)
        if now - self.since >= self.max_hold_s and not prefilling:
            log.info("background_hold_bound_reached", held_s=round(now - self.since, 3), held=len(background))
            self._end(now)
            self.bound_hits += 1
            HOLD_BOUND.inc()
            return batch, []
        foreground = [s for s in batch if not s.background]
        if foreground:
            self.rounds += 1
            HELD_ROUNDS.labels(cause).inc()
        return foreground, background

    def quiet(self, now: float) -> bool:
        """Nothing holds background sequences now (no recent foreground sequence, no host flag): a round
        of background sequences only that starts now may be preempted (see the module docstring)."""
        return self.since is None and not self._recent and now >= self.host_until

    def preempted(self) -> None:
        """A preemptible round's model call was stopped for foreground work."""
        self.preemptions += 1
        PREEMPTED.inc()

    def wait_s(self, now: float) -> float:
        """With nothing but held sequences to run: how long until the hold may end by itself (the
        recent foreground going idle, the host flag expiring, the bound); 0: it may end now. A new
        sequence, a closed one or a change of the host flag must wake the caller sooner."""
        if self.since is None:
            return 0.0
        ends = max((t + self.idle_s for t in self._recent.values()), default=0.0)
        ends = min(max(ends, self.host_until), self.since + self.max_hold_s)
        return max(0.0, ends - now)

    def _end(self, now: float) -> None:
        if self.since is not None:
            HELD_SECONDS.inc(now - self.since)
            self.held_s += now - self.since
            self.since = None
