"""A lean Redis client for hot single-command paths: one connection, commands pipelined in order.

Redis answers the commands of a connection in the order it received them, so one connection can
carry any number of concurrent commands: each call writes its command at once (no await before the
bytes leave, no pool to check out of) and waits for its reply in a FIFO of futures. redis-py's pool
costs ~0.1-0.2 ms of CPU per command around the send (pool lock, connection checks, observability
hooks) on this machine, which sits on the path to the first token when the gateway admits a request
(docs/gateway.md, "Numbers"). This client does only what those paths need: commands and scripts
(EVALSHA, EVAL on NOSCRIPT), AUTH/SELECT/CLIENT SETNAME from the URL, a timeout per command, and a
bound on commands in flight.

Failures raise redis-py's exceptions (``ConnectionError``, ``TimeoutError``, ``ResponseError``: all
``RedisError``), so callers handle them as they handle redis-py's. A timeout or a lost connection
fails every command in flight on that connection (their replies can no longer be matched) and
closes it; the next command connects again. Only plain TCP URLs (``redis://``) are supported:
:func:`supports` says whether a URL is, and callers keep redis-py for the others (TLS, Unix sockets).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import deque
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

Arg = str | bytes | int | float


def supports(url: str) -> bool:
    """Whether ``url`` is one this client speaks (``redis://host[:port][/db]``, optional credentials)."""
    try:
        return urlsplit(url).scheme == "redis"
    except ValueError:
        return False


def _pack(args: Sequence[Arg]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int):
            data = b"%d" % arg
        else:
            data = repr(float(arg)).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _Protocol(asyncio.Protocol):
    """One connection: the replies it reads resolve the waiting futures in order."""

    def __init__(self, client: PipelinedRedis) -> None:
        self._client = client
        self._reader = hiredis.Reader()
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                if not self.waiting:
                    raise hiredis.ProtocolError("a reply came with no command waiting for it")
                future = self.waiting.popleft()
                if future.done():  # its caller gave up (cancelled): the reply is dropped
                    continue
                if isinstance(reply, hiredis.ReplyError):
                    future.set_exception(ResponseError(str(reply)))
                else:
                    future.set_result(reply)
        except hiredis.ProtocolError as exc:
            self.fail(ConnectionError(f"Redis sent a reply that cannot be parsed: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError("the connection to Redis was closed"))

    def fail(self, error: Exception) -> None:
        """Close the connection and fail every command waiting on it."""
        if self.closed:
            return
        self.closed = True
        self._client._forget(self)
        if self.transport is not None:
            self.transport.abort()
        waiting, self.waiting = self.waiting, deque()
        for future in waiting:
            if not future.done():
                future.set_exception(error)


class PipelinedRedis:
    """Commands over one pipelined connection (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.25,
        connect_timeout_s: float | None = None,
        client_name: str = "",
        max_in_flight: int = 10_000,
    ) -> None:
        if not supports(url):
            raise ValueError(f"{url!r} is not a redis:// URL; use redis-py for TLS or Unix sockets")
        parts = urlsplit(url)
        self._host = parts.hostname or "localhost"
        self._port = parts.port or 6379
        self._username = unquote(parts.username) if parts.username else ""
        self._password = unquote(parts.password) if parts.password else ""
        path = parts.path.strip("/")
        self._db = int(path) if path else 0
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s or timeout_s
        self._client_name = client_name
        self._max_in_flight = max_in_flight
        self._conn: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None

    async def execute(self, *args: Arg) -> Any:
        """Send one command and return its reply (raises ResponseError for an error reply)."""
        conn = self._conn if self._conn is not None else await self._connect()
        return await self._send(conn, args)

    def script(self, source: str) -> Script:
        return Script(self, source)

    async def aclose(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(BaseException):
                await self._connecting
        if self._conn is not None:
            self._conn.fail(ConnectionError("the client was closed"))

    def disconnect(self) -> None:
        """Drop the connection (commands in flight fail); the next command connects again."""
        if self._conn is not None:
            self._conn.fail(ConnectionError("the connection was dropped"))

    def _send(self, conn: _Protocol, args: Sequence[Arg]) -> asyncio.Future[Any]:
        if len(conn.waiting) >= self._max_in_flight:
            raise ConnectionError(f"{self._max_in_flight} Redis commands are already in flight; retry shortly")
        assert conn.transport is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        conn.transport.write(_pack(args))
        conn.waiting.append(future)
        timer = loop.call_later(self._timeout_s, _expire, conn, future, self._timeout_s)
        future.add_done_callback(lambda _f: timer.cancel())
        return future

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._open())
        task = self._connecting
        try:
            return await asyncio.shield(task)
        finally:
            if task.done() and self._connecting is task:
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Protocol(self), self._host, self._port)
        except TimeoutError:
            raise TimeoutError(f"connecting to Redis at {self._host}:{self._port} timed out") from None
        except OSError as exc:
            raise ConnectionError(f"cannot connect to Redis at {self._host}:{self._port}: {exc}") from None
        setup: list[asyncio.Future[Any]] = []
        if self._password:
            user: tuple[Arg, ...] = (self._username,) if self._username else ()
            setup.append(self._send(conn, ("AUTH", *user, self._password)))
        if self._db:
            setup.append(self._send(conn, ("SELECT", self._db)))
        if self._client_name:
            setup.append(self._send(conn, ("CLIENT", "SETNAME", self._client_name)))
        try:
            await asyncio.gather(*setup)
        except BaseException:
            conn.fail(ConnectionError("the connection to Redis could not be set up"))
            raise
        self._conn = conn
        return conn

    def _forget(self, conn: _Protocol) -> None:
        if self._conn is conn:
            self._conn = None


def _expire(conn: _Protocol, future: asyncio.Future[Any], timeout_s: float) -> None:
    if not future.done():
        # Later replies on this connection can no longer be matched to their commands: close it.
        conn.fail(TimeoutError(f"Redis did not answer within {timeout_s:g} s"))


class Script:
    """A Lua script run with EVALSHA, falling back to EVAL when Redis does not have it cached."""

    def __init__(self, client: PipelinedRedis, source: str) -> None:
        self._client = client
        self._source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Arg] = (), args: Sequence[Arg] = ()) -> Any:
        try:
            return await self._client.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self._client.execute("EVAL", self._source, len(keys), *keys, *args)
