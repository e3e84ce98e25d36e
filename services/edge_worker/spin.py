"""Adaptive thread spinning: per decode call, the session whose intra-op threads spin or the one whose sleep.

onnxruntime fixes spinning per session (``session.intra_op.allow_spinning``), and neither setting wins
everywhere on a small CPU (docs/edge.md): on an idle host a lone stream's two-row call takes ~15 %
less wall time when the threads spin inside it (the ~300 parallel sections of a call hand over without
a wake-up each), while on a loaded host a spinning thread waits on a preempted peer and the same call
takes several times longer. The load is what other processes do, which the worker cannot see, so the
engine keeps both sessions (same graph, same thread count: the same kernels and the same split of the
work, so bit-identical outputs) and :class:`SpinChooser` picks one per call from the wall times it
measured: the faster one by median over recent calls of that size, with the other one probed now and
then, less and less often while it keeps losing.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Arm:
    times: deque[float]

    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None


@dataclass
class _Choice:
    """The chooser's state for one call size."""

    window: int
    arms: dict[bool, _Arm] = field(default_factory=dict)
    current: bool = True
    calls: int = 0
    """Calls since the last probe ended."""
    interval: int = 0
    """Calls between probes of the losing mode (doubles while it keeps losing)."""
    probing: int = 0
    """Calls left in the probe in progress (they run the other mode)."""

    def arm(self, spin: bool) -> _Arm:
        if spin not in self.arms:
            self.arms[spin] = _Arm(deque(maxlen=self.window))
        return self.arms[spin]


class SpinChooser:
    """Chooses spinning or sleeping threads for each decode call of up to ``max_rows`` rows.

    ``probe_every``: calls between probes of the losing mode at first; each probe that confirms the
    winner doubles the gap, up to ``max_probe_every``, and a change of winner resets it.
    ``probe_calls``: calls per probe. ``window``: recent calls per mode whose median is compared.
    Calls of more rows always sleep (a large call is long enough that the wake-ups do not matter, and
    spinning threads take the CPU that the other sequences' worker threads need).
    """

    def __init__(
        self,
        *,
        max_rows: int = 4,
        probe_every: int = 16,
        max_probe_every: int = 512,
        probe_calls: int = 3,
        window: int = 9,
    ) -> None:
        self.max_rows = max_rows
        self.probe_every = max(1, probe_every)
        self.max_probe_every = max(self.probe_every, max_probe_every)
        self.probe_calls = max(1, probe_calls)
        self.window = max(1, window)
        self._choices: dict[int, _Choice] = {}
        self.spun = 0
        """Calls run on the spinning session so far."""

    def choose(self, rows: int) -> bool:
        """True: run this call of ``rows`` rows on the spinning session."""
        if rows > self.max_rows:
            return False
        state = self._choices.get(rows)
        if state is None:
            state = self._choices[rows] = _Choice(self.window, interval=self.probe_every)
        for spin in (True, False):  # measure both before comparing
            if len(state.arm(spin).times) < self.probe_calls:
                return spin
        if state.probing:
            return not state.current
        return state.current

    def record(self, rows: int, spin: bool, seconds: float) -> None:
        """The wall time of a call ``choose(rows)`` sent to the ``spin`` session."""
        state = self._choices.get(rows)
        if state is None or rows > self.max_rows:
            return
        self.spun += spin
        state.arm(spin).times.append(seconds)
        if state.probing:
            state.probing -= 1
            if state.probing:
                return
            state.calls = 0
        elif spin == state.current:
            state.calls += 1
        self._decide(state)

    def _decide(self, state: _Choice) -> None:
        spin, sleep = state.arm(True).median(), state.arm(False).median()
        if spin is None or sleep is None or len(state.arm(not state.current).times) < self.probe_calls:
            return
        best = spin < sleep
        if best != state.current:
            state.current = best
            state.interval = self.probe_every
            state.calls = 0
        elif state.calls == 0:  # a probe just confirmed the winner: probe less often
            state.interval = min(2 * state.interval, self.max_probe_every)
        if state.calls >= state.interval:
            state.probing = self.probe_calls
            state.arm(not state.current).times.clear()  # the probe's calls replace the old ones
