"""The engine loop: one thread that steps every live sequence together and hands each step's outputs
to the event loop in one call.

The event loop never waits for the model: it queues commands (:meth:`EngineLoop.add`,
:meth:`EngineLoop.stop`), which the loop thread applies between two steps, and receives outputs
through ``deliver`` (called on the event loop, with every step finished since its last call). The
loop thread runs :meth:`Engine.step` back to back while the engine has work, and sleeps on a
condition otherwise, so a worker's thread count is this thread plus the engine's own compute pool,
whatever the number of streams.

Overlap: the model call releases the GIL on both tiers, so while the loop thread runs step t+1 the
event loop processes step t's outputs (detokenization, stop strings, frames). A stream whose turn
ended meanwhile (a stop string found in step t) was stepped once more for nothing; its stop reaches
the engine before step t+2. The loop runs at most :data:`MAX_UNREAD_STEPS` steps ahead of the event
loop's processing, so memory and the work done past a stop stay bounded when the event loop is the
slower of the two (a zero-cost engine, a loaded host).

Paused (:meth:`EngineLoop.pause`, while the model sleeps: services/worker/sleep.py), the thread runs
commands only (the release and the restore are commands) and never asks the engine for a step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import structlog

from services.worker.types import Engine, NewSequence, SequenceOutput

log = structlog.get_logger(__name__)

MAX_UNREAD_STEPS = 2
"""Steps handed to the event loop and not processed yet before the loop thread waits for it."""

Deliver = Callable[[list[list[SequenceOutput]]], None]
"""Takes the outputs of one or more steps, oldest first (on the event loop)."""


class StepFailed(Exception):
    """A whole step raised (the engine could not attribute the failure to its sequences)."""


class EngineLoop:
    """Runs ``engine`` on its own thread (see the module docstring). ``start`` binds the engine's
    wake-up and starts the thread; ``close`` stops it (the engine's owner closes the engine)."""

    def __init__(self, engine: Engine, deliver: Deliver, *, name: str = "engine-loop") -> None:
        self.engine, self._deliver, self._name = engine, deliver, name
        self._cv = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._ready: list[list[SequenceOutput]] = []
        self._unread, self._scheduled, self._stopped = 0, False, False
        self._paused = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.steps = 0
        """Steps run so far."""

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the thread; outputs go to ``deliver`` on ``loop``."""
        self._loop = loop
        self.engine.bind(self.wake)
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    # --- the event loop's side (any thread, in fact: every method only takes the lock) ------------

    def add(self, seqs: Sequence[NewSequence]) -> None:
        """Add the sequences of one turn together (a fork is added right after its source); one that
        the engine refuses gets an output with the error."""
        seqs = list(seqs)
        if self.engine.capabilities.background and any(not seq.background for seq in seqs):
            self.engine.interrupt_background()  # a step of batch work only may stop for this one
        self._command(lambda: self._add(seqs))

    def stop(self, seq_id: int, hold: bool = False) -> None:
        """End a sequence, or free a held one (:meth:`Engine.stop`), before the next step."""
        self._command(lambda: self.engine.stop(seq_id, hold))

    def call(self, fn: Callable[[Engine], object]) -> Future[object]:
        """Run ``fn(engine)`` on the loop thread between two steps; its result or error in the future."""
        future: Future[object] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

        self._command(run)
        return future

    def pause(self) -> None:
        """Step nothing from now on (commands still run) until :meth:`resume`: the model is released."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        """Step again after :meth:`pause` (the model is loaded)."""
        with self._cv:
            self._paused = False
            self._cv.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def wake(self) -> None:
        """Make the loop thread ask the engine for work again (the engine's own arrivals)."""
        with self._cv:
            self._cv.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after the step in flight (blocking, bounded)."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("engine_loop_did_not_stop", timeout_s=timeout_s)

    def _command(self, command: Callable[[], None]) -> None:
        with self._cv:
            if self._stopped:
                raise RuntimeError("the engine loop is stopped")
            self._commands.append(command)
            self._cv.notify()

    def _drain(self) -> None:
        """On the event loop: every step handed over since the last drain, in one ``deliver`` call."""
        with self._cv:
            steps, self._ready = self._ready, []
            self._scheduled = False
        try:
            self._deliver(steps)
        finally:
            with self._cv:
                self._unread -= len(steps)
                self._cv.notify()

    # --- the loop thread ------------------------------------------------------------------------

    def _add(self, seqs: list[NewSequence]) -> None:
        failed = []
        for seq in seqs:
            try:
                self.engine.add(seq)
            except Exception as exc:  # that sequence fails, the others go on
                failed.append(SequenceOutput(seq.id, error=exc))
        if failed:
            self._hand_off(failed)

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while True:
                    if self._stopped:
                        return
                    wait = (
                        engine.next_step_in() if self._unread < MAX_UNREAD_STEPS and not self._paused else None
                    )  # None: the drain (or resume) wakes us
                    if self._commands or (wait is not None and wait <= 0):
                        break
                    self._cv.wait(wait)
                commands, self._commands = self._commands, []
            for command in commands:
                try:
                    command()
                except Exception:  # a command's failure is its own (add reports it); the loop goes on
                    log.exception("engine_command_failed")
            if self._unread >= MAX_UNREAD_STEPS or self._paused:
                continue
            wait = engine.next_step_in()
            if wait is None or wait > 0:
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                log.exception("engine_step_failed")
                outputs = [SequenceOutput(-1, error=StepFailed(str(exc) or type(exc).__name__))]
            self.steps += 1
            if outputs:
                self._hand_off(outputs)

    def _hand_off(self, outputs: list[SequenceOutput]) -> None:
        with self._cv:
            self._ready.append(outputs)
            self._unread += 1
            schedule = not self._scheduled
            self._scheduled = True
        if schedule:
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the event loop is closed (shutdown): nobody reads any more
                with self._cv:
                    self._stopped = True
