"""Sleep and wake: the worker gives its model's memory back while idle and loads it again on demand.

States (:class:`~services.common.model_state.ModelState`): ``AWAKE`` ->
``FALLING_ASLEEP`` (the engine releases its model on the loop thread: :meth:`Engine.release_model`) ->
``ASLEEP`` -> ``WAKING`` (:meth:`Engine.restore_model`) -> ``AWAKE``. The process stays: imports, the
tokenizer, the servicer and its connections to the routers.

Contract (:class:`ModelSleep`, event loop only):

* **Users.** A turn (queued or running) and a model call outside the loop (Worker.Embed, ImportKV,
  ExportKV) is a *user* from :meth:`ModelSleep.enter` to :meth:`ModelSleep.leave`; ``enter`` succeeds
  only while awake. A turn that finds the model asleep or falling asleep calls :meth:`wake` and waits
  (with keepalives), then enters: a turn is never refused for being asleep.
* **Sleep(only_if_idle).** Refused (FailedPrecondition) while there is a user, a wake caller, or a
  chat sequence held between turns that is not idle-expired (expired ones are swept first: a chat
  idle past ``chat_idle_timeout_s`` is freed anyway, so it does not keep the model awake). The check
  and the move to FALLING_ASLEEP happen in one event-loop step, so a turn arriving at the same moment
  either counts as a user (refused) or comes after and wakes the model again.
  Without only_if_idle, every turn is cancelled (it ends CANCELLED), calls in flight are waited for,
  and held chats are dropped (their next turn prefills its whole context).
* **Release.** The loop is paused (it steps nothing), the engine releases its model on the loop
  thread after every stop queued before it, then glibc's ``malloc_trim(0)`` returns freed heap pages
  to the system, so the resident size really drops. The resident size awake minus asleep is what a
  wake will need again.
* **Wake.** One load for every concurrent caller (Wake RPCs and waiting turns alike). Before it,
  MemAvailable (/proc/meminfo) must hold what the model took (times the host's processes that load it
  alike: a tensor-parallel group's ranks, ``EngineCapabilities.load_processes``) plus ``margin_bytes``; else
  ResourceExhausted, and the worker stays asleep (logged). A failed load is Unavailable, and the
  worker stays asleep. A caller that goes away (cancelled) stops counting; when the load completes
  with no caller, no user and no turn waiting, the model goes back to sleep (outcome ``abandoned``).

Every state change calls the ``on_change`` hooks (the heartbeater sends a report at once) and sets
the ``meshserve_worker_model_state`` gauge.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog
from prometheus_client import Counter, Gauge, Histogram

from services.common.errors import FailedPrecondition, MeshError, ResourceExhausted, Unavailable
from services.common.model_state import ModelState
from services.worker.loop import EngineLoop
from services.worker.sessions import ChatSessions
from services.worker.types import Engine

log = structlog.get_logger(__name__)

MODEL_STATE = Gauge(
    "meshserve_worker_model_state",
    "Where the worker's model is: 0 awake, 1 asleep (memory released), 2 waking (loading), 3 falling asleep.",
)
_GAUGED = {ModelState.AWAKE: 0, ModelState.ASLEEP: 1, ModelState.WAKING: 2, ModelState.FALLING_ASLEEP: 3}
"""The gauge's value of each state (docs/metrics.md; the same numbers as the wire's)."""
SLEEPS = Counter("meshserve_worker_sleeps_total", "Times the worker released its model (Worker.Sleep).")
WAKES = Counter(
    "meshserve_worker_wakes_total",
    "Model loads after a sleep, by outcome: ok, abandoned (every caller left: back to sleep), failed, no_memory.",
    ["outcome"],
)
WAKE_SECONDS = Histogram(
    "meshserve_worker_wake_seconds",
    "Seconds a wake took to load the model (successful loads).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
)
RESIDENT = Gauge("meshserve_worker_resident_bytes", "The worker process's resident memory (RSS), in bytes.")
for _outcome in ("ok", "abandoned", "failed", "no_memory"):
    WAKES.labels(_outcome)


@dataclass(frozen=True)
class Transition:
    """What a Sleep or Wake reached: the state, the seconds the release or load took (0: nothing to
    do), the process's resident bytes after it."""

    state: ModelState
    seconds: float
    resident_bytes: int


class User(Protocol):
    """Something that needs the model awake (a turn); ``cancel`` ends it (a forced sleep)."""

    def cancel(self) -> None: ...


class HostMemory:
    """The process's resident size and the host's available memory (Linux /proc), and glibc's trim.

    Our own: psutil would do the two reads, but it is not a dependency and these are two lines of /proc.
    """

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._trim: Callable[[int], int] | None = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to trim with
            self._trim = None

    def resident_bytes(self) -> int:
        """RSS now (/proc/self/statm: resident pages * page size); 0 when unknown."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return 0

    def available_bytes(self) -> int | None:
        """MemAvailable of /proc/meminfo; None when unknown (no check is made then)."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None

    def trim(self) -> None:
        """Hand freed heap pages back to the system (``malloc_trim(0)``; blocking: call from a thread)."""
        if self._trim is not None:
            self._trim(0)


class _Call:
    """A user that cannot be cancelled (a Worker.Embed in a thread): a forced sleep waits for it."""

    def cancel(self) -> None:
        return None


class ModelSleep:
    """The state machine of one worker's model (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        loop: EngineLoop,
        sessions: ChatSessions,
        *,
        margin_bytes: int = 64 << 20,
        memory: HostMemory | None = None,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.sessions = sessions
        self.margin_bytes = margin_bytes
        self.memory = memory or HostMemory()
        self.state = ModelState.AWAKE
        self.on_change: list[Callable[[ModelState], None]] = []
        """Called on the event loop after every state change (the heartbeater's ``beat_now``)."""
        self.needed_bytes = 0
        """Resident bytes the model took when it was last awake (awake minus asleep, at the last sleep)."""
        self.loads = 0
        """Loads run (successful or not): one per wake however many callers shared it."""
        self.sleeps = 0
        self._users: set[User] = set()
        self._calls = 0
        self._calls_done = asyncio.Event()
        self._calls_done.set()
        self._callers = 0
        self.waiting = 0
        """Turns waiting for a wake to enter (the runner counts them): busy, and the load not abandoned."""
        self._sleeping: asyncio.Future[Transition] | None = None
        self._load: asyncio.Future[Transition] | None = None
        MODEL_STATE.set(0)
        RESIDENT.set_function(self.memory.resident_bytes)

    # --- users ------------------------------------------------------------------------------------

    @property
    def awake(self) -> bool:
        return self.state is ModelState.AWAKE

    def enter(self, user: User) -> bool:
        """``user`` needs the model from now on; False (nothing taken) unless it is awake."""
        if self.state is not ModelState.AWAKE:
            return False
        self._users.add(user)
        return True

    def leave(self, user: User) -> None:
        """``user`` is done with the model (idempotent)."""
        self._users.discard(user)

    async def use(self) -> _Call:
        """Wake the model if needed and hold it awake for a call outside the loop (an Embed); the
        caller :meth:`release_call` s the returned token."""
        call = _Call()
        while not self.enter(call):
            await self.wake()
        self._calls += 1
        self._calls_done.clear()
        return call

    def release_call(self, call: _Call) -> None:
        self.leave(call)
        self._calls -= 1
        if self._calls == 0:
            self._calls_done.set()

    def busy(self) -> str:
        """Why Sleep(only_if_idle) is refused now ("" when idle); sweeps idle-expired chats first."""
        self.sessions.sweep()
        if self._users:
            return f"{len(self._users)} turns or calls are running or queued"
        if self._callers or self.waiting:
            return "a wake is in progress"
        if self.sessions.held:
            return f"{self.sessions.held} chats keep their KV between turns"
        return ""

    # --- sleep ------------------------------------------------------------------------------------

    async def sleep(self, only_if_idle: bool = False) -> Transition:
        """Release the model (see the module docstring); an asleep worker answers at once."""
        self._check_capable()
        while True:
            if self.state is ModelState.ASLEEP:
                return Transition(ModelState.ASLEEP, 0.0, self.memory.resident_bytes())
            if self.state is ModelState.FALLING_ASLEEP and self._sleeping is not None:
                return await asyncio.shield(self._sleeping)
            if self.state is ModelState.WAKING and self._load is not None:
                if only_if_idle:
                    raise FailedPrecondition("the model is waking for a request; it is not idle")
                await asyncio.wait({self._load})  # forced: after the load (its outcome is its callers')
                continue
            break
        if only_if_idle and (reason := self.busy()):
            raise FailedPrecondition(f"the worker is not idle ({reason}); send Sleep without only_if_idle to force it")
        self._set(ModelState.FALLING_ASLEEP)  # in the same event-loop step as the check: no turn slips in
        return await asyncio.shield(self._fall_asleep_task())

    def _fall_asleep_task(self) -> asyncio.Future[Transition]:
        task = asyncio.ensure_future(self._fall_asleep())
        task.add_done_callback(_retrieve)
        self._sleeping = task
        return task

    async def _fall_asleep(self) -> Transition:
        began = time.perf_counter()
        try:
            for user in list(self._users):  # only a forced sleep finds any: they end CANCELLED
                user.cancel()
            dropped = self.sessions.clear()  # frees the held chat sequences (stops queued before the release)
            await self._calls_done.wait()
            awake_bytes = self.memory.resident_bytes()
            self.loop.pause()
            try:
                await asyncio.wrap_future(self.loop.call(lambda engine: engine.release_model()))
            except Exception as exc:
                log.exception("model_release_failed")
                await self._recover()
                raise Unavailable(f"the model could not be released ({exc}); it stays loaded") from None
            await asyncio.to_thread(self.memory.trim)
            asleep_bytes = self.memory.resident_bytes()
            self.needed_bytes = max(0, awake_bytes - asleep_bytes)
            seconds = time.perf_counter() - began
            self.sleeps += 1
            SLEEPS.inc()
            self._set(ModelState.ASLEEP)
            log.info(
                "model_asleep",
                seconds=round(seconds, 3),
                resident_bytes_awake=awake_bytes,
                resident_bytes_asleep=asleep_bytes,
                chats_dropped=dropped,
            )
            return Transition(ModelState.ASLEEP, seconds, asleep_bytes)
        finally:
            self._sleeping = None

    async def _recover(self) -> None:
        """After a failed release: load what may be gone, and serve again."""
        try:
            await asyncio.wrap_future(self.loop.call(lambda engine: engine.restore_model()))
        except Exception:
            log.exception("model_restore_after_failed_release_failed")
        self.loop.resume()
        self._set(ModelState.AWAKE)

    # --- wake -------------------------------------------------------------------------------------

    async def wake(self) -> Transition:
        """Load the model, sharing the load in progress; answers once it serves (see the module
        docstring). Cancelling this call counts as this caller going away; the load goes on."""
        self._check_capable()
        if self.state is ModelState.AWAKE:
            return Transition(ModelState.AWAKE, 0.0, self.memory.resident_bytes())
        if self._load is None:
            self._load = asyncio.ensure_future(self._wake_up())
            self._load.add_done_callback(_retrieve)
        load = self._load
        self._callers += 1
        try:
            return await asyncio.shield(load)
        finally:
            self._callers -= 1

    async def _wake_up(self) -> Transition:
        try:
            if self._sleeping is not None:  # a sleep in progress ends first; then this loads again
                await asyncio.wait({self._sleeping})
            if self.state is ModelState.AWAKE:  # the release failed and the model stayed
                return Transition(ModelState.AWAKE, 0.0, self.memory.resident_bytes())
            self._check_memory()
            began = time.perf_counter()
            self.loads += 1
            self._set(ModelState.WAKING)
            try:
                await asyncio.wrap_future(self.loop.call(lambda engine: engine.restore_model()))
            except MeshError as exc:
                self._wake_failed("no_memory" if isinstance(exc, ResourceExhausted) else "failed", exc)
                raise
            except Exception as exc:
                self._wake_failed("failed", exc)
                raise Unavailable(f"the model failed to load ({exc}); see the worker's log") from None
            self.loop.resume()
            seconds = time.perf_counter() - began
            WAKE_SECONDS.observe(seconds)
            self._set(ModelState.AWAKE)
            abandoned = self._callers == 0 and not self._users and not self.waiting
            WAKES.labels("abandoned" if abandoned else "ok").inc()
            resident = self.memory.resident_bytes()
            log.info("model_woken", seconds=round(seconds, 3), resident_bytes=resident, callers=self._callers)
            if abandoned:  # nobody waits for it any more: back to sleep (in this same step, nobody slips in)
                log.info("model_wake_abandoned", action="sleep again")
                self._set(ModelState.FALLING_ASLEEP)
                self._fall_asleep_task()
            return Transition(ModelState.AWAKE, seconds, resident)
        finally:
            self._load = None

    def _check_memory(self) -> None:
        available = self.memory.available_bytes()
        need = self.needed_bytes * self.engine.capabilities.load_processes + self.margin_bytes
        if available is not None and available < need:
            WAKES.labels("no_memory").inc()
            log.warning("model_wake_refused_no_memory", available_bytes=available, needed_bytes=need)
            raise ResourceExhausted(
                f"the host has {available >> 20} MiB of memory available but waking the model needs about "
                f"{need >> 20} MiB; free memory on this host or send the request to another replica"
            )

    def _wake_failed(self, outcome: str, exc: BaseException) -> None:
        WAKES.labels(outcome).inc()
        self._set(ModelState.ASLEEP)  # the loop stays paused: the engine is still released
        log.warning("model_wake_failed", outcome=outcome, error=str(exc) or type(exc).__name__)

    # --- helpers ----------------------------------------------------------------------------------

    def _check_capable(self) -> None:
        caps = self.engine.capabilities
        if not caps.sleeps:
            raise FailedPrecondition(f"this worker's {caps.name} engine cannot release its model (no sleep)")

    def _set(self, state: ModelState) -> None:
        if state is self.state:
            return
        self.state = state
        MODEL_STATE.set(_GAUGED[state])
        for hook in list(self.on_change):
            try:
                hook(state)
            except Exception:  # a report hook never breaks the state machine
                log.exception("model_state_hook_failed")


def _retrieve(future: asyncio.Future[Transition]) -> None:
    """Mark a task's error as seen (its callers may all have gone away)."""
    if not future.cancelled():
        future.exception()
