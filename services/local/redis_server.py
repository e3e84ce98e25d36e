"""The Redis servers of the local mesh: ``meshserve up``'s cache Redis and state Redis (their
arguments), started as child processes (:func:`spawn_redis`) whose memory-overcommit warning is
replaced by one line saying what it means for that Redis (:func:`redis_sink`).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from collections.abc import Sequence

from services.common.processes import LogSink, ServiceProcess, free_port, yield_on_wakeup

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
