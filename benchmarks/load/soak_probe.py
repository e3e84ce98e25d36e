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

import json
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
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


@dataclass
class Endpoints:
    """Who holds which TCP endpoint in the mesh (from :func:`port_owners`)."""

    listen: dict[int, str] = field(default_factory=dict)
    """Listening port → process."""
    conns: dict[tuple[str, int, str, int], str] = field(default_factory=dict)
    """(local ip, local port, remote ip, remote port) of a connected socket → process holding it."""

    def peer(self, laddr: Any, raddr: Any) -> str:
        """The process at the other end of the connection ``laddr`` → ``raddr``, or "other"."""
        found = self.conns.get((raddr.ip, raddr.port, laddr.ip, laddr.port))
        return found or self.listen.get(raddr.port, "other")


def port_owners(procs: dict[str, psutil.Process]) -> Endpoints:
    """The TCP endpoints of ``procs`` (ports alone are ambiguous: Linux reuses an ephemeral port for
    connections to different destinations)."""
    out = Endpoints()
    for name, proc in procs.items():
        try:
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.laddr and c.status == psutil.CONN_LISTEN:
                out.listen[c.laddr.port] = name
            elif c.laddr and c.raddr:
                out.conns[(c.laddr.ip, c.laddr.port, c.raddr.ip, c.raddr.port)] = name
    return out


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


def fd_kinds(proc: psutil.Process, owners: Endpoints) -> dict[str, int]:
    """Open fds of ``proc`` by kind (see the module docstring); {} if the process is gone.

    A TCP connection is ``tcp->X`` when we connected to X and ``tcp<-X`` when X connected to us (the
    local port is one we listen on); ``owners`` is :func:`port_owners` of the mesh.
    """
    try:
        conns = {c.fd: c for c in proc.net_connections(kind="all") if c.fd != -1}
        fds = os.listdir(f"/proc/{proc.pid}/fd")
    except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, PermissionError):
        return {}
    listening = {c.laddr.port for c in conns.values() if c.status == psutil.CONN_LISTEN and c.laddr}
    kinds: Counter[str] = Counter()
    for entry in fds:
        conn = conns.get(int(entry))
        if conn is not None:
            if conn.family == socket.AF_UNIX:
                kinds["unix"] += 1
            elif conn.status == psutil.CONN_LISTEN:
                kinds["listen"] += 1
            elif conn.raddr:
                accepted = conn.laddr.port in listening
                kinds[f"tcp{'<-' if accepted else '->'}{owners.peer(conn.laddr, conn.raddr)}"] += 1
            else:
                kinds["tcp (unconnected)"] += 1
            continue
        try:
            link = os.readlink(f"/proc/{proc.pid}/fd/{entry}")
        except OSError:  # closed since listdir
            continue
        kinds[_link_kind(link)] += 1
    return dict(sorted(kinds.items()))


def redis_client_owners(clients: list[dict[str, Any]], owners: Endpoints) -> dict[str, int]:
    """``CLIENT LIST`` entries per owning mesh process (matched on both ends of the connection)."""
    counts: Counter[str] = Counter()
    for client in clients:
        cip, _, cport = str(client.get("addr", ":0")).rpartition(":")
        sip, _, sport = str(client.get("laddr", ":0")).rpartition(":")
        name = owners.conns.get((cip, int(cport or 0), sip, int(sport or 0)))
        counts[name or "other (not a mesh process: this benchmark, redis-cli)"] += 1
    return dict(sorted(counts.items()))


class LogCounter:
    """A mesh log sink that counts warning and error events per service (JSON lines from structlog).

    ``phase`` is set by the soak (ramp, fill, soak) so the report can say when they happened.
    """

    def __init__(self) -> None:
        self.phase = "start"
        self.counts: Counter[tuple[str, str, str, str]] = Counter()

    def __call__(self, name: str, line: str) -> None:
        if '"level"' not in line or not any(f'"{lvl}"' in line for lvl in ("warning", "error", "critical")):
            return
        try:
            event = json.loads(line)
        except ValueError:
            return
        level = str(event.get("level", ""))
        if level in ("warning", "error", "critical"):
            self.counts[(self.phase, name, level, str(event.get("event", "?")))] += 1

    def summary(self) -> list[dict[str, Any]]:
        """One row per (phase, service, level, event), most frequent first."""
        return [
            {"phase": p, "service": s, "level": lvl, "event": e, "count": n}
            for (p, s, lvl, e), n in self.counts.most_common()
        ]
