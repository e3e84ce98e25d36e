"""Adaptive threading: per small decode call, the session (threads, spinning) that measures fastest now.

onnxruntime fixes a session's intra-op threads and their spinning (``session.intra_op.allow_spinning``)
when it is made, and no one setting wins everywhere on a small CPU (docs/edge.md). A lone stream's
two-row call on 2 cores: on an idle host threads that spin inside the call are fastest (the ~300
parallel sections of a call hand over without a wake-up each); on a loaded host a spinning thread
waits on a preempted peer and the call takes twice as long as with sleeping threads, and one thread
alone is faster still (no peer to wait for). The load is other processes' work, which the worker
cannot see, so the engine keeps one session per choice (same graph: the same kernels, and every output
element computed whole by one thread, so bit-identical outputs) and :class:`SessionChooser` picks one
per call from the wall times it measured: the fastest by median over recent calls of that size, with
the others probed now and then, less and less often while the winner stays.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Size:
    """The chooser's state for calls of one row count."""

    modes: int
    window: int
    probe_every: int
    times: list[deque[float]] = field(default_factory=list)
    current: int = 0
    tick: int = 0
    """Calls of this size so far (after every mode was measured once)."""
    gap: list[int] = field(default_factory=list)
    """Per mode: calls between its probes while it loses (doubles each time a probe confirms that)."""
    due: list[int] = field(default_factory=list)
    """Per mode: the ``tick`` of its next probe."""
    probe: int | None = None
    """The mode being probed, if a probe is in progress."""
    probing: int = 0
    """Calls left in the probe in progress."""

    def __post_init__(self) -> None:
        self.times = [deque(maxlen=self.window) for _ in range(self.modes)]
        self.gap = [self.probe_every] * self.modes
        self.due = [self.probe_every] * self.modes

    def median(self, mode: int) -> float:
        return statistics.median(self.times[mode]) if self.times[mode] else float("inf")


class SessionChooser:
    """Chooses one of ``modes`` sessions for each decode call of up to ``max_rows`` rows.

    Every mode is measured ``probe_calls`` times first; then calls go to the mode with the lowest
    median of its last ``window`` calls. Each losing mode is probed again (``probe_calls`` calls that
    replace its old measurements) ``probe_every`` calls later, then after twice as many calls each time
    a probe finds it still losing, up to ``max_probe_every``: a mode that is much slower under the
    current load (spinning threads on a busy host: several times slower) costs less and less.
    Calls of more rows are not chosen for (``choose`` returns None: the caller's default session).
    """

    def __init__(
        self,
        modes: int,
        *,
        max_rows: int = 4,
        probe_every: int = 32,
        max_probe_every: int = 2048,
        probe_calls: int = 3,
        window: int = 9,
    ) -> None:
        self.modes = modes
        self.max_rows = max_rows
        self.probe_every = max(1, probe_every)
        self.max_probe_every = max(self.probe_every, max_probe_every)
        self.probe_calls = max(1, probe_calls)
        self.window = max(self.probe_calls, window)
        self._sizes: dict[int, _Size] = {}
        self.calls = [0] * modes
        """Calls run on each mode so far."""

    def choose(self, rows: int) -> int | None:
        """The mode for this call of ``rows`` rows (None: more than ``max_rows``)."""
        if rows > self.max_rows:
            return None
        state = self._sizes.get(rows)
        if state is None:
            state = self._sizes[rows] = _Size(self.modes, self.window, self.probe_every)
        for mode in range(self.modes):  # measure every mode before comparing
            if len(state.times[mode]) < self.probe_calls:
                return mode
        return state.probe if state.probe is not None else state.current

    def record(self, rows: int, mode: int, seconds: float) -> None:
        """The wall time of a call that ``choose(rows)`` sent to ``mode``."""
        state = self._sizes.get(rows)
        if state is None:
            return
        self.calls[mode] += 1
        state.times[mode].append(seconds)
        if state.probe is None and any(len(times) < self.probe_calls for times in state.times):
            return  # still measuring every mode once
        state.tick += 1
        probed = None
        if state.probe is not None:
            state.probing -= 1
            if state.probing > 0:
                return
            probed, state.probe = state.probe, None
        best = min(range(self.modes), key=state.median)
        if best != state.current:  # the old winner becomes a loser, probed soon
            state.gap[state.current] = self.probe_every
            state.due[state.current] = state.tick + self.probe_every
            state.current = best
        if probed is not None and probed != state.current:  # still losing: probe it less often
            state.gap[probed] = min(2 * state.gap[probed], self.max_probe_every)
            state.due[probed] = state.tick + state.gap[probed]
        if probed is not None:
            return  # a probe just ended: the winner runs the next call (back-to-back probes would starve it)
        due = [other for other in range(self.modes) if other != state.current and state.due[other] <= state.tick]
        if due:  # the longest overdue first: two modes trading the lead never starve a third of probes
            other = min(due, key=lambda mode: state.due[mode])
            state.probe, state.probing = other, self.probe_calls
            state.times[other].clear()  # the probe's calls replace its old measurements
