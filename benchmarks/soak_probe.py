"""What the soak reads besides RSS and fd counts: Redis's memory/eviction counters, and what each fd is.

* :func:`redis_stats` — ``INFO`` fields that tell a full cache from a leak: ``used_memory`` against
  ``maxmemory`` and ``evicted_keys`` (a cache at its bound evicts; its memory stops growing), plus
  ``connected_clients``.
* :func:`fd_kinds` — a process's open fds by kind: TCP connections named by the mesh process at the
  other end (``tcp->redis-server``, ``tcp<-gateway``), listening sockets, unix sockets,
  pipes, anonymous inodes (epoll, eventfd) and files. When a process's fd count changes, this says
  which kind of fd it gained.
* :func:`redis_client_owners` — ``CLIENT LIST`` entries attributed to the mesh process whose local
  port they come from: which service holds how many Redis connections.

psutil reads /proc; no process is stopped or traced.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from typing import Any

import psutil
import redis.asyncio as aioredis

REDIS_FIELDS = ("used_memory", "used_memory_rss", "maxmemory", "evicted_keys", "connected_clients", "keys")
"""INFO fields sampled during the soak (``keys`` is DBSIZE)."""


async def redis_stats(client: aioredis.Redis) -> dict[str, float]:
    """The :data:`REDIS_FIELDS` of one Redis (memory in bytes, counters as numbers)."""
    info = await client.info()
    out = {k: float(info.get(k, 0)) for k in REDIS_FIELDS if k != "keys"}
    out["keys"] = float(await client.dbsize())
    return out


def port_owners(procs: dict[str, psutil.Process]) -> dict[int, tuple[str, bool]]:
    """Local TCP port → (mesh process that holds it, whether it listens there)."""
    owners: dict[int, tuple[str, bool]] = {}
    for name, proc in procs.items():
        try:
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.laddr and c.status == psutil.CONN_LISTEN:  # accepted sockets share the listening port
                owners[c.laddr.port] = (name, True)
            elif c.laddr and c.raddr:
                owners.setdefault(c.laddr.port, (name, False))
    return owners


def _link_kind(link: str) -> str:
    if link.startswith("pipe:"):
        return "pipe"
    if link.startswith("anon_inode:"):
        return link.removeprefix("anon_inode:").strip("[]")
    if link.startswith("socket:"):
        return "socket (other)"
    if link.startswith("/dev/"):
        return "device"
    return "file"


def fd_kinds(proc: psutil.Process, owners: dict[int, tuple[str, bool]]) -> dict[str, int]:
    """Open fds of ``proc`` by kind (see the module docstring); {} if the process is gone.

    A TCP connection is ``tcp->X`` when X listens on the peer port (we connected to X) and ``tcp<-X``
    when the peer port is X's own end of a connection (X connected to us); ``owners`` is
    :func:`port_owners` of the mesh.
    """
    try:
        conns = {c.fd: c for c in proc.net_connections(kind="all") if c.fd != -1}
        fds = os.listdir(f"/proc/{proc.pid}/fd")
    except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, PermissionError):
        return {}
    kinds: Counter[str] = Counter()
    for entry in fds:
        conn = conns.get(int(entry))
        if conn is not None:
            if conn.family == socket.AF_UNIX:
                kinds["unix"] += 1
            elif conn.status == psutil.CONN_LISTEN:
                kinds["listen"] += 1
            elif conn.raddr:
                peer, listens = owners.get(conn.raddr.port, ("other", True))
                kinds[f"tcp->{peer}" if listens else f"tcp<-{peer}"] += 1
            else:
                kinds["tcp (unconnected)"] += 1
            continue
        try:
            link = os.readlink(f"/proc/{proc.pid}/fd/{entry}")
        except OSError:  # closed since listdir
            continue
        kinds[_link_kind(link)] += 1
    return dict(sorted(kinds.items()))


def redis_client_owners(clients: list[dict[str, Any]], owners: dict[int, tuple[str, bool]]) -> dict[str, int]:
    """``CLIENT LIST`` entries per owning mesh process (matched on the client's local port)."""
    counts: Counter[str] = Counter()
    for client in clients:
        port = int(str(client.get("addr", ":0")).rpartition(":")[2] or 0)
        name, listens = owners.get(port, ("other", True))
        counts[name if not listens else "other (not a mesh process: this benchmark, redis-cli)"] += 1
    return dict(sorted(counts.items()))
