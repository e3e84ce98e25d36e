"""A cancel that reaches a turn's prefill (see :class:`PrefillInterrupter`)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class PrefillInterrupter:
    """Lets a cancel reach a turn's first step (its prefill), which the stop flag checked between
    steps cannot: a long context is seconds of model calls inside one ``step()``.

    ``fire`` (the cancel, on the event loop) interrupts the sequence armed now, or the one armed
    later; the worker thread arms the sequence just before its first step and disarms it after.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: Callable[[], None] | None = None
        self.fired = False

    def arm(self, interrupt: Callable[[], None]) -> None:
        with self._lock:
            self._target = interrupt
            if self.fired:
                interrupt()

    def disarm(self) -> None:
        with self._lock:
            self._target = None

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            if self._target is not None:
                self._target()
