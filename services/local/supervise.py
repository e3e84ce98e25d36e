"""Restart what crashed: ``meshserve up`` supervises its children as compose's ``restart: unless-stopped``.

One asyncio task per child waits for it to exit (never blocking the loop). An exit the mesh did not
ask for is recorded (``killed by SIGKILL``, ``exit code 1``) and the child is started again with the
same command and environment after an exponential backoff (:class:`RestartPolicy`: 0.5 s, doubling
to 8 s; back to 0.5 s once it has stayed up 30 s), then waited on until it serves again (its
``ready`` check: gRPC health, Redis PING, Envoy's admin). What must keep its address restarts on
the same port (the mesh pins it in the child's environment before the first restart: gateways,
cache, the split router, the front door's adapters; Redis and Envoy are started with fixed ports
anyway); workers take a free port and register again by heartbeat.

Crash loop: ``loop_restarts`` restarts within ``loop_window_s`` (5 in 60 s) is a crash loop. It is
reported, not hidden: one ``service_crash_loop`` line at error level, and the state says
``crash loop`` (``meshserve status`` shows it) until the service has stayed up ``reset_after_s``. The
service keeps being restarted at the capped backoff meanwhile (as compose and Kubernetes'
CrashLoopBackOff do): a fault that clears (a port freed, a disk emptied) heals without a restart of
the mesh, and the cap keeps a broken service from eating the CPU the others need.

Warm spares (``standby``): a restart runs the service in a spare process that has already done its
imports (``ServiceProcess.start_standby``, services/common/child.py), started when the watch begins
and again once a restarted service serves; the mesh gives one to each Python service.

Stopped on purpose: :meth:`Supervisor.stop_service` stops a running child and parks its watch (the
state says ``stopped (idle)``, or the reason given; no restart, no crash-loop count) until
:meth:`Supervisor.start_service` starts it again and waits until it serves. The local scaler
(services/local/scaler.py) stops an idle model's workers this way and starts one when a request is
held for it. A stopped child keeps its warm spare, so its start from zero skips the imports.

Stopping: :meth:`Supervisor.close` cancels every watch (a restart under way included, its new
process stopped) before the mesh stops its children, so Ctrl-C never races a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.common.processes import LogSink, ServiceProcess

Ready = Callable[[ServiceProcess], Awaitable[None]]
BeforeRestart = Callable[[ServiceProcess], None]
"""Waits until a (re)started child serves; raises (RuntimeError, TimeoutError, OSError...) if it does not."""

SUPERVISOR = "supervisor"
"""The name the supervisor's own log lines carry in the merged log."""


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a child that exited (defaults: docs/architecture.md, *meshserve up*)."""

    base_s: float = 0.5
    """Delay before the first restart; doubled for each further one in a row."""
    cap_s: float = 8.0
    """Longest delay between restarts."""
    reset_after_s: float = 30.0
    """A child up this long before it exits starts again from ``base_s`` (and leaves a crash loop)."""
    loop_restarts: int = 5
    """This many restarts within ``loop_window_s`` is a crash loop."""
    loop_window_s: float = 60.0
    ready_timeout_s: float = 120.0
    """How long a restarted child may take to serve before it counts as failing again."""

    def delay_s(self, in_a_row: int) -> float:
        """Backoff before restart number ``in_a_row`` (1, 2, ...) of an unbroken series."""
        return min(self.cap_s, self.base_s * 2 ** max(0, in_a_row - 1))


def exit_reason(returncode: int | None) -> str:
    """``killed by SIGKILL`` for a signal, ``exit code N`` otherwise."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class ServiceRecord:
    """What ``meshserve status`` shows of one supervised child."""

    state: str = "running"
    """``running``, ``restarting`` (waiting out the backoff or for the new process to serve),
    ``crash loop`` (restarting too often, see the module docstring), ``stopping (<reason>)`` then
    ``stopped (<reason>)`` (stopped on purpose: :meth:`Supervisor.stop_service`; the pid is ``None`` once
    stopped) or ``starting`` (:meth:`Supervisor.start_service`)."""
    restarts: int = 0
    last_exit: str = ""
    last_exit_at: str = ""
    """UTC time of the last unexpected exit (ISO 8601), "" if none."""
    pid: int | None = None
    in_a_row: int = 0
    recent: deque[float] = field(default_factory=deque)
    """Monotonic times of the restarts within the crash-loop window."""
    stopped_for: str = ""
    """Why it was stopped on purpose ("" while it is not): its exit is then no crash to restart."""
    stopped_at: str = ""
    """UTC time it was last stopped on purpose (ISO 8601), "" if never."""
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by :meth:`Supervisor.start_service` once the stopped child serves again: its watch goes on."""

    def as_dict(self) -> dict[str, object]:
        return {
            "state": self.state,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "last_exit_at": self.last_exit_at,
            "pid": self.pid,
            **({"stopped_at": self.stopped_at} if self.stopped_at else {}),
        }


class Supervisor:
    """Watches children and restarts those that exit; ``on_change`` runs after every state change."""

    def __init__(
        self, sink: LogSink, policy: RestartPolicy | None = None, on_change: Callable[[], None] | None = None
    ) -> None:
        self.sink = sink
        self.policy = policy or RestartPolicy()
        self.on_change = on_change
        self.records: dict[str, ServiceRecord] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._watched: dict[str, tuple[ServiceProcess, Ready]] = {}
        self._closed = False

    def watch(
        self,
        proc: ServiceProcess,
        ready: Ready,
        before_restart: BeforeRestart | None = None,
        *,
        standby: bool = False,
    ) -> None:
        """Supervise ``proc`` (already started). ``before_restart`` may adjust it (pin its port) first.
        ``standby``: keep a warm spare of it (``ServiceProcess.start_standby``), started now and again
        after each restart once the restarted process serves (not while it loads: the CPU is its)."""
        if self._closed:
            raise RuntimeError("the supervisor is closed")
        self.records[proc.name] = ServiceRecord(pid=proc.proc.pid if proc.proc else None)
        self._watched[proc.name] = (proc, ready)
        self._tasks[proc.name] = asyncio.create_task(
            self._watch(proc, ready, before_restart, standby), name=f"watch-{proc.name}"
        )

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {name: record.as_dict() for name, record in self.records.items()}

    def is_running(self, name: str) -> bool:
        """The child runs and serves (or is being started on purpose): neither stopped nor restarting."""
        record = self.records.get(name)
        return record is not None and record.state in ("running", "starting")

    def is_stopped(self, name: str) -> bool:
        """The child was stopped on purpose (:meth:`stop_service`) and not started since."""
        record = self.records.get(name)
        return record is not None and bool(record.stopped_for) and record.state != "starting"

    async def stop_service(self, name: str, reason: str = "idle", grace_s: float = 15.0) -> bool:
        """Stop a running child on purpose: SIGTERM (it drains and tells the routers it leaves), and no
        restart until :meth:`start_service`. False (nothing done) unless it is ``running``: one being
        restarted or in a crash loop is left to the restart policy."""
        record = self.records[name]
        if self._closed or record.state != "running" or record.stopped_for:
            return False
        proc, _ = self._watched[name]
        record.stopped_for = reason
        record.resumed = asyncio.Event()
        record.state = f"stopping ({reason})"  # until its process has exited: its pid is still shown
        record.stopped_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self._log("service_stopped", "info", service=name, reason=reason, pid=record.pid)
        self._changed()
        await proc.stop(grace_s, keep_standby=True)  # its watch sees the exit and parks
        record.pid = None
        record.state = f"stopped ({reason})"
        self._changed()
        return True

    async def start_service(self, name: str) -> None:
        """Start a child stopped on purpose and wait until it serves (its ``ready`` check); its watch
        (the restart policy) then goes on. A child that does not come up is killed, stays stopped, and
        the error is raised: the caller decides when to try again. Nothing to do unless it is stopped."""
        record = self.records[name]
        if self._closed or not record.stopped_for or record.state == "starting":
            return
        proc, ready = self._watched[name]
        reason = record.stopped_for
        record.state = "starting"
        self._log("service_starting", "info", service=name, stopped_for=reason)
        self._changed()
        try:
            await proc.respawn()
            record.pid = proc.proc.pid if proc.proc else None
            await ready(proc)
        except BaseException:
            proc.signal(signal.SIGKILL)
            with contextlib.suppress(Exception):
                await proc.stop(5.0, keep_standby=True)
            record.pid = None
            record.state = f"stopped ({reason})"
            self._changed()
            raise
        record.stopped_for = ""
        record.state = "running"
        record.resumed.set()
        self._log("service_started_again", "info", service=name, pid=record.pid)
        self._changed()

    async def close(self) -> None:
        """Stop watching (nothing is restarted after this); a child being restarted is stopped."""
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _log(self, event: str, level: str, **values: object) -> None:
        line = {"event": event, "level": level, "timestamp": dt.datetime.now(dt.UTC).isoformat(), **values}
        self.sink(SUPERVISOR, json.dumps(line))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def _watch(
        self, proc: ServiceProcess, ready: Ready, before_restart: BeforeRestart | None, standby: bool
    ) -> None:
        record = self.records[proc.name]
        policy = self.policy
        if standby:
            await self._start_standby(proc)
        up_since = time.monotonic()
        unready = ""  # why the last restart did not serve (we killed it: that, not the signal, is its exit)
        while True:
            assert proc.proc is not None
            returncode = await proc.proc.wait()
            proc.kill_group()  # what it started (torchrun's ranks) goes with it
            if record.stopped_for:  # stopped on purpose: no restart until start_service
                await record.resumed.wait()
                up_since = time.monotonic()
                if standby:
                    await self._start_standby(proc)  # start_service used the spare
                continue
            now = time.monotonic()
            if now - up_since >= policy.reset_after_s:
                record.in_a_row = 0
            record.in_a_row += 1
            while record.recent and now - record.recent[0] > policy.loop_window_s:
                record.recent.popleft()
            record.recent.append(now)
            record.last_exit = unready or exit_reason(returncode)
            unready = ""
            record.last_exit_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            record.pid = None
            delay = policy.delay_s(record.in_a_row)
            looping = len(record.recent) >= policy.loop_restarts
            if looping and record.state != "crash loop":
                self._log(
                    "service_crash_loop",
                    "error",
                    service=proc.name,
                    restarts_in_window=len(record.recent),
                    window_s=policy.loop_window_s,
                    last_exit=record.last_exit,
                    restart_every_s=policy.cap_s,
                    fix=f"see the lines marked {proc.name} for why it exits; it is restarted until it stays up",
                )
            record.state = "crash loop" if looping else "restarting"
            self._log("service_exited", "warning", service=proc.name, exit=record.last_exit, restart_in_s=delay)
            self._changed()
            await asyncio.sleep(delay)  # the backoff itself, not a readiness wait
            if before_restart is not None:
                before_restart(proc)
            try:
                await proc.respawn()
                record.restarts += 1
                record.pid = proc.proc.pid if proc.proc else None
                await ready(proc)
            except asyncio.CancelledError:
                await proc.stop(5.0)
                raise
            except Exception as exc:  # any failure to come back counts as one more exit
                error = " ".join(str(exc).split()) or type(exc).__name__
                unready = f"did not serve after a restart: {error}"
                self._log("service_restart_failed", "error", service=proc.name, error=error)
                proc.signal(signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await proc.stop(5.0)
                up_since = time.monotonic()
                continue
            up_since = time.monotonic()
            if record.state != "crash loop":
                record.state = "running"
            else:
                asyncio.get_running_loop().call_later(policy.reset_after_s, self._settled, proc.name, up_since)
            self._log("service_restarted", "info", service=proc.name, pid=record.pid, restarts=record.restarts)
            self._changed()
            if standby:
                await self._start_standby(proc)

    async def _start_standby(self, proc: ServiceProcess) -> None:
        try:
            await proc.start_standby()
        except OSError as exc:  # no spare is no failure: the next restart starts a fresh process
            self._log("service_standby_not_started", "warning", service=proc.name, error=str(exc))

    def _settled(self, name: str, restarted_at: float) -> None:
        """A service out of a crash loop: up ``reset_after_s`` since its restart at ``restarted_at``."""
        record = self.records.get(name)
        if record is None or self._closed or record.state != "crash loop" or record.pid is None:
            return
        if record.recent and record.recent[-1] > restarted_at:  # it exited again meanwhile
            return
        record.state = "running"
        record.recent.clear()
        self._changed()
