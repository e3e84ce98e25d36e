"""Redis clients from a URL: single server, Sentinel or Cluster, all with millisecond timeouts.

* ``redis://[:password@]host:port/db``, ``rediss://...``, ``unix:///path`` — one server.
* ``redis+sentinel://[:password@]host1:26379,host2:26379/<master name>[/db]`` — the current
  master of ``<master name>`` as Sentinel reports it (re-resolved after a failover).
* ``redis+cluster://[:password@]host1:7000,host2:7001`` — Redis Cluster (slots discovered from any
  listed node). Every multi-key operation of services/cache stays in one slot (keys.py hash tags).

One try per call (no redis-py retries): a retry would only double the latency of a miss; the
circuit breaker handles outages. Connecting has ``timeout_s``; reads have ``read_timeout_s`` when
given, else no socket timeout: guard.py's watchdog bounds every call instead (redis-py's socket
timeout arms a Task and two timers per command, which cost as much as parsing a small GET's reply).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

AnyRedis = aioredis.Redis | RedisCluster
SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"


class _SentinelMaster(aioredis.Redis):
    """The master's client; closing it also closes the connections to the Sentinels."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for sentinel in self.connection_pool.sentinel_manager.sentinels:  # type: ignore[attr-defined]
            await sentinel.aclose()


def _hosts(netloc: str, default_port: int) -> tuple[str | None, list[tuple[str, int]]]:
    password = None
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        password = unquote(cred.split(":", 1)[1] if ":" in cred else cred) or None
    hosts = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        if not host:
            host, port = part, str(default_port)
        if not port.isdigit():
            raise ValueError(f"bad Redis host:port {part!r}; write it as host:port")
        hosts.append((host, int(port)))
    if not hosts or not hosts[0][0]:
        raise ValueError("the Redis URL names no host; e.g. redis+cluster://127.0.0.1:7000")
    return password, hosts


def check_redis_url(url: str) -> str:
    """``url`` if it is one :func:`redis_from_url` accepts ("" allowed: no Redis); else ValueError with
    the fix, for a settings validator. Builds a client without connecting."""
    if url:
        redis_from_url(url, 1.0)
    return url


def redis_from_url(
    url: str,
    timeout_s: float,
    *,
    max_connections: int = 64,
    read_timeout_s: float | None = None,
    client_name: str | None = None,
) -> AnyRedis:
    """A client for ``url`` (see the module docstring); raises ValueError for a malformed URL.

    ``read_timeout_s`` sets a socket read timeout for callers that do not bound calls themselves.
    ``max_connections`` bounds the pool (per node on Cluster): a call beyond it fails at once.
    ``client_name`` is set on every connection (CLIENT LIST).
    """
    common: dict[str, Any] = dict(
        socket_timeout=read_timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        client_name=client_name,
    )
    parts = urlsplit(url)
    if parts.scheme == CLUSTER_SCHEME:
        password, hosts = _hosts(parts.netloc, 6379)
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in hosts],
            password=password,
            max_connections=max_connections,
            **common,
        )
    if parts.scheme == SENTINEL_SCHEME:
        password, hosts = _hosts(parts.netloc, 26379)
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError("a Sentinel URL must name the master: redis+sentinel://host:26379/mymaster[/db]")
        db = int(path[1]) if len(path) > 1 else 0
        sentinel = Sentinel(hosts, sentinel_kwargs={"socket_timeout": timeout_s}, **common)
        return sentinel.master_for(
            path[0], redis_class=_SentinelMaster, db=db, password=password, max_connections=max_connections
        )
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"unsupported Redis URL scheme {parts.scheme!r}; use redis://, rediss://, unix://, "
            f"{SENTINEL_SCHEME}:// or {CLUSTER_SCHEME}://"
        )
    return aioredis.Redis.from_url(url, max_connections=max_connections, **common)
