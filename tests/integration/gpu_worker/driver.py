"""tests/engine_driver.py's ``EngineDriver`` for the cloud engine, which does work on its own I/O thread
(a Redis prefix load): while the engine
has nothing to step (``next_step_in() is None``) and sequences are live, the driver waits for the
engine's wake-up, as the worker's engine loop sleeps until it (services/worker/loop.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from services.worker.types import Engine, SequenceOutput
from tests.engine_driver import EngineDriver, Result


class CloudDriver(EngineDriver):
    """An :class:`EngineDriver` that waits (bounded) for the engine's wake-up when it has no work."""

    def __init__(self, engine: Engine, *, idle_timeout_s: float = 60.0) -> None:
        super().__init__(engine)
        self.idle_timeout_s = idle_timeout_s
        self.woken = threading.Event()
        self.waits = 0
        """Times a step waited for the wake-up (the I/O thread was working)."""
        engine.bind(self.woken.set)

    def ready(self) -> bool:
        """Whether the engine has a step to run now (clears the wake-up first: one after this is kept)."""
        self.woken.clear()
        wait = self.engine.next_step_in()
        return wait is not None and wait <= 0

    def wait_for_work(self) -> None:
        """Until the engine has a step to run (AssertionError after ``idle_timeout_s`` with none)."""
        while not self.ready():
            self.waits += 1
            assert self.woken.wait(self.idle_timeout_s), f"the engine had nothing to do for {self.idle_timeout_s} s"

    def step_when_ready(self) -> list[SequenceOutput]:
        self.wait_for_work()
        return self.step()

    def run(self, ids: Sequence[int] | None = None, *, max_steps: int = 100_000) -> dict[int, Result]:
        wanted = list(self.results) if ids is None else list(ids)
        for _ in range(max_steps):
            if all(self.results[i].ended for i in wanted):
                return {i: self.results[i] for i in wanted}
            self.step_when_ready()
        raise AssertionError(f"sequences did not end within {max_steps} steps")

    def run_until(self, seq_id: int, tokens: int = 1, *, max_steps: int = 100_000) -> Result:
        """Step until sequence ``seq_id`` has ``tokens`` tokens (or ended); its result."""
        result = self.results[seq_id]
        for _ in range(max_steps):
            if len(result.tokens) >= tokens or result.ended:
                return result
            self.step_when_ready()
        raise AssertionError(f"sequence {seq_id} did not get {tokens} tokens within {max_steps} steps")
