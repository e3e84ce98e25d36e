"""Child processes of the local mesh: spawn, relay logs, wait for health, stop or kill.

Used by :mod:`services.local.mesh` (`meshserve up`) and the front door launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
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
            "services.local.child",  # execs argv; the child gets SIGTERM if we die
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
        (services/local/child.py, ``--standby``), so a restart skips the imports. One at a time."""
        if not self.can_stand_by or (self._standby is not None and self._standby.returncode is None):
            return
        self._standby = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.local.child",
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


REDIS_OVERCOMMIT_WARNING = "WARNING Memory overcommit must be enabled!"
REDIS_OVERCOMMIT_NOTE = (
    "note: vm.overcommit_memory is not 1, which redis warns about because a background save or replica"
    " sync forks; this redis runs with no persistence and no replicas, so it does not fork and the warning"
    " does not apply (silence it with `sudo sysctl vm.overcommit_memory=1`, or leave it)"
)


REDIS_STATE_OVERCOMMIT_NOTE = (
    "note: vm.overcommit_memory is not 1, which redis warns about because a rewrite of its append-only file"
    " forks; under memory pressure such a rewrite may fail (the file then keeps growing until one succeeds;"
    " nothing is lost). `sudo sysctl vm.overcommit_memory=1` avoids it"
)

NO_PERSISTENCE = ("--save", "", "--appendonly", "no")
"""A Redis that keeps nothing on disk (the default of :func:`spawn_redis`)."""


def cache_redis_args(maxmemory: str) -> tuple[str, ...]:
    """The cache Redis of ``meshserve up`` (response cache, KV prefix blocks, rate-limit buckets): no
    persistence, at most ``maxmemory``, least recently used keys evicted above it (docs/cache.md)."""
    return (*NO_PERSISTENCE, "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru")


STATE_REDIS_ARGS = (
    "--save",
    "",
    "--appendonly",
    "yes",
    "--appendfsync",
    "always",
    "--maxmemory-policy",
    "noeviction",
)
"""The state Redis of ``meshserve up`` (API keys, files, batches, stored responses): every write in an
append-only file (AOF) in its ``--dir``, replayed on start; never evicts (``noeviction``: a write beyond
a ``maxmemory`` fails instead of dropping a batch). No RDB snapshots: the AOF is the one copy.

``appendfsync always``, not Redis's default ``everysec``: with ``everysec`` Redis postpones writing
the file (up to 2 s) while an earlier background fsync is still running, and answers meanwhile, so a
kill -9 of Redis on a busy disk can lose writes it acknowledged (tests/integration/local/
test_state_redis.py lost a file upload that way once in ~20 runs on the shared test host). With
``always`` the write and its fsync happen before any answer (one fsync per event-loop turn, shared by
every command of that turn). This Redis carries no per-request traffic (the limiter and the caches are
in the cache Redis), so the fsyncs cost batch lines and uploads a millisecond or so, nothing else
(docs/architecture.md, *Cache and state Redis*)."""


def redis_sink(sink: LogSink, note: str = REDIS_OVERCOMMIT_NOTE) -> LogSink:
    """``sink`` with redis's memory-overcommit warning (a paragraph on every start when the kernel's
    ``vm.overcommit_memory`` is not 1, which only root can change) replaced by one line, ``note``,
    saying what it means for this Redis. Every other line passes unchanged."""

    def relay(name: str, line: str) -> None:
        sink(name, note if REDIS_OVERCOMMIT_WARNING in line else line)

    return relay


async def spawn_redis(
    directory: str,
    sink: LogSink,
    env: dict[str, str],
    *,
    args: Sequence[str] = NO_PERSISTENCE,
    batch: bool = True,
    name: str = "redis",
) -> tuple[ServiceProcess, str]:
    """Start redis-server on a free loopback port (``directory`` as its working and data directory,
    then ``args``: no persistence by default) and wait until it answers (a persistent one has then
    replayed its append-only file). Returns the process (named ``name`` in the log) and its URL; with
    ``batch`` it runs under :func:`yield_on_wakeup`. RuntimeError when redis-server is not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed; run `make setup`")
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory]
    persistent = ("--appendonly", "yes") in itertools.pairwise(args)  # it forks to rewrite its AOF
    note = REDIS_STATE_OVERCOMMIT_NOTE if persistent else REDIS_OVERCOMMIT_NOTE
    proc = ServiceProcess(name, [*argv, *args], env, redis_sink(sink, note))
    await proc.spawn()
    url = f"redis://127.0.0.1:{port}/0"
    await wait_redis(url, 30.0)  # its threads have started once it answers
    if batch and proc.proc is not None:
        yield_on_wakeup(proc.proc.pid)
    return proc, url


async def wait_redis(url: str, timeout_s: float) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_connect_timeout=0.2)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while True:
            try:
                await client.ping()
                return
            except (OSError, aioredis.ConnectionError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.02)  # redis has no health stream; this polls a just-spawned process
    finally:
        await client.aclose()
