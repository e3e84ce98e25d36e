"""Child processes of our services: spawn, relay logs, wait for health, stop or kill.

Used by the launcher of the local mesh (:mod:`services.local.mesh`, ``meshserve up``), the front door
launcher (:mod:`services.controlplane.frontdoor`), the benchmarks and the tests. Knows how our services
announce themselves (their ``service_started`` log line) and nothing of the mesh they form; every child
is started through :mod:`services.common.child`, so it dies with its launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LogSink = Callable[[str, str], None]
"""Receives (process name, log line) for every line a child prints."""

LOG_LINE_LIMIT = 1 << 20
"""Bytes of one relayed log line; a longer line is dropped (with a note) and the relay goes on. A relay
that stopped would leave the child blocked on a full pipe the next time it logs."""


class ServiceProcess:
    """One child process of the mesh, with its log relayed line by line."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], sink: LogSink) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.sink = sink
        self.proc: asyncio.subprocess.Process | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._started = asyncio.Event()
        self._relay: asyncio.Task[None] | None = None
        self._port_from_log = False  # the port came from its service_started line (read again on respawn)
        self._standby: asyncio.subprocess.Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def spawn(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.common.child",  # execs argv; the child gets SIGTERM if we die
            str(os.getpid()),
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            limit=LOG_LINE_LIMIT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
        )
        self._relay = asyncio.create_task(self._relay_logs())

    async def respawn(self) -> None:
        """Start the same command again once it has exited (services/local/supervise.py), in its warm
        spare if it has one (:meth:`start_standby`). The port and metrics port are read from its log
        again, unless the port was set by hand (Envoy's)."""
        if self._port_from_log:
            self.port = None
        self.metrics_port = None
        self._started = asyncio.Event()
        spare, self._standby = self._standby, None
        if spare is not None and spare.returncode is None and spare.stdin is not None:
            try:
                spare.stdin.write(json.dumps({"env": self.env}).encode() + b"\n")
                await spare.stdin.drain()
                spare.stdin.close()
            except (BrokenPipeError, ConnectionResetError):  # it died meanwhile: start afresh
                pass
            else:
                self.proc = spare
                self._relay = asyncio.create_task(self._relay_logs())
                return
        await self.spawn()  # the old relay ends by itself at the old pipe's end

    @property
    def can_stand_by(self) -> bool:
        """A ``python -m MODULE`` service (no launcher such as torchrun in between) can have a warm spare."""
        return len(self.argv) == 3 and self.argv[0] == sys.executable and self.argv[1] == "-m"

    async def start_standby(self) -> None:
        """Start a warm spare: a process that has imported the service's modules and waits to run it
        (services/common/child.py, ``--standby``), so a restart skips the imports. One at a time."""
        if not self.can_stand_by or (self._standby is not None and self._standby.returncode is None):
            return
        self._standby = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.common.child",
            "--standby",
            str(os.getpid()),
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            limit=LOG_LINE_LIMIT,
            start_new_session=True,
        )

    async def stop_standby(self) -> None:
        spare, self._standby = self._standby, None
        if spare is not None and spare.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                spare.kill()  # it holds nothing yet: no port, no model
            await spare.wait()

    def kill_group(self) -> None:
        """SIGKILL whatever is left of its process group (children of an exited process: torchrun's ranks)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def _relay_logs(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stdout = self.proc.stdout
        skip_rest = False  # the tail of a line longer than the reader's limit is still to come
        while True:
            try:
                line = await stdout.readline()
            except ValueError as exc:  # longer than LOG_LINE_LIMIT: readline dropped what it had read
                skip_rest = "not found" in str(exc)
                self.sink(self.name, f"(a log line of over {LOG_LINE_LIMIT} bytes was dropped)")
                continue
            if not line:
                return
            if skip_rest:
                skip_rest = False
                continue
            text = line.decode(errors="replace").rstrip()
            if self.port is None and '"service_started"' in text:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    started = json.loads(text)
                    self.port = int(started["port"])
                    self._port_from_log = True
                    if started.get("metrics_port"):
                        self.metrics_port = int(started["metrics_port"])
                    self._started.set()
            self.sink(self.name, text)

    async def wait_started(self, timeout_s: float) -> None:
        """Wait for the service_started line, failing fast if the process dies first."""
        assert self.proc is not None
        started = asyncio.create_task(self._started.wait())
        exited = asyncio.create_task(self.proc.wait())
        done, _ = await asyncio.wait({started, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in (started, exited):
            if task not in done:
                task.cancel()
        if started not in done:
            if exited in done:
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before serving; "
                    f"see its log (the lines marked {self.name})"
                )
            raise TimeoutError(f"{self.name} did not start within {timeout_s:.0f} s; see its log")

    async def wait_serving(self, timeout_s: float) -> None:
        try:
            await wait_for_health(self.address, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.name} did not report SERVING within {timeout_s:.0f} s; see its log") from None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def stop(self, timeout_s: float = 15.0, *, keep_standby: bool = False) -> None:
        """SIGTERM (graceful drain), then SIGKILL after ``timeout_s``; its warm spare goes too, unless
        ``keep_standby`` (a worker stopped while idle: the spare makes its start from zero quicker)."""
        if not keep_standby:
            await self.stop_standby()
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.proc.wait()
        if self._relay is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._relay, 5)

    async def kill(self) -> None:
        """SIGKILL now (fault injection)."""
        if self.proc is None:
            return
        self.signal(signal.SIGKILL)
        await self.proc.wait()


async def wait_for_health(address: str, timeout_s: float, service: str = "") -> None:
    """Block until ``address`` reports SERVING over grpc.health.v1 Watch (no polling sleeps)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def watch() -> None:
            while True:
                try:
                    call = stub.Watch(health_pb2.HealthCheckRequest(service=service), wait_for_ready=True)
                    async for reply in call:
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    await channel.channel_ready()

        try:
            await asyncio.wait_for(watch(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f} s") from None


def stdout_sink(stream: TextIO = sys.stdout) -> LogSink:
    width = 14

    def sink(name: str, line: str) -> None:
        stream.write(f"{name:<{width}}| {line}\n")
        stream.flush()

    return sink


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def yield_on_wakeup(pid: int) -> bool:
    """Put every thread of process ``pid`` under ``SCHED_BATCH``: when a request wakes it, it waits
    for a free core instead of preempting the process that woke it. Returns whether any thread changed.

    For a helper that the request path wakes in passing, on the same few cores: the gateway's
    rate-limit command to a co-located Redis made Redis preempt the gateway inside its send (a socket
    wake-up prefers the waker's core), so the gateway's routing waited for Redis's script to run
    (docs/gateway.md, *Numbers*). Under ``SCHED_BATCH`` Redis runs once a core is free, usually while
    the gateway waits on the worker; its share of the CPU stays that of a normal process (nice 0).
    A no-op off Linux, or for a process that is gone; threads it starts later inherit the policy.
    """
    if not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    changed = False
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
            changed = True
    return changed
