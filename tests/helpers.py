"""Shared test utilities: real redis-server processes and free loopback ports."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    """A real redis-server on loopback; ``stop()``/``start()`` simulate an outage on the same port."""

    port: int
    dir: str
    proc: subprocess.Popen[bytes] | None = None
    extra_args: tuple[str, ...] = ()
    """More redis-server options (later ones win), e.g. ``("--appendonly", "yes")`` for persistence."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed; run `make setup`")
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--maxmemory",
                "256mb",
                "--maxmemory-policy",
                "allkeys-lru",
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)  # polling readiness of a process we just started (no health API)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(port=free_port(), dir=tmp)
        server.start()
        try:
            yield server
        finally:
            server.stop()


SENTINEL_MASTER = "mymaster"
"""Master name of :func:`redis_sentinel` (the last part of its ``redis+sentinel://`` URL)."""


def wait_for_sentinel_master(port: int, expect: tuple[str, int], timeout_s: float = 10.0) -> None:
    """Poll the Sentinel on ``port`` until it reports ``expect`` as the master (it has no health API)."""
    client = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=0.5, decode_responses=True)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                addr = client.sentinel_get_master_addr_by_name(SENTINEL_MASTER)
                if isinstance(addr, tuple) and (addr[0], int(addr[1])) == expect:
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"sentinel on port {port} never reported master {expect}")
            time.sleep(0.02)
    finally:
        client.close()


@contextmanager
def redis_sentinel(master: RedisServer, dir: str) -> Iterator[int]:
    """A real Sentinel (``redis-server --sentinel``) monitoring ``master`` as :data:`SENTINEL_MASTER`;
    yields its port (URL: ``redis+sentinel://127.0.0.1:<port>/mymaster``)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed; run `make setup`")
    port = free_port()
    conf = f"{dir}/sentinel-{port}.conf"  # Sentinel rewrites its config file: it must be writable
    with open(conf, "w") as f:
        f.write(
            f"port {port}\nbind 127.0.0.1\ndir {dir}\n"
            f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master.port} 1\n"
            f"sentinel down-after-milliseconds {SENTINEL_MASTER} 500\n"
            f"sentinel failover-timeout {SENTINEL_MASTER} 2000\n"
        )
    proc = subprocess.Popen([exe, conf, "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_sentinel_master(port, ("127.0.0.1", master.port))
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextmanager
def redis_cluster_node(dir: str, timeout_s: float = 10.0) -> Iterator[int]:
    """A real one-node Redis Cluster (cluster mode, all 16384 slots on it); yields its port
    (URL: ``redis+cluster://127.0.0.1:<port>``).

    A cluster node refuses any multi-key command whose keys hash to different slots (CROSSSLOT), even
    when it owns them all: one node is a real cluster for what clients see.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed; run `make setup`")
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", dir, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    argv += ["--cluster-port", str(free_port())]  # the default bus port (port + 10000) may be invalid
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    try:
        deadline = time.monotonic() + timeout_s
        while True:  # readiness of a process we just started: bounded polling, no health API
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            if time.monotonic() > deadline:
                raise TimeoutError("cluster did not reach state ok")
            time.sleep(0.02)
        yield port
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)
