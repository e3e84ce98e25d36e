"""The stream transport: the router's worker streams over a plain TCP connection, without gRPC.

Why: grpc.aio hands every message through three threads (an event-engine thread reads the socket,
a poller thread takes the completion and wakes the event loop through a socketpair, the loop runs
the coroutine), and every hand-off is a wake-up of a thread whose caches a model's prefill has
just evicted. A connection served by the event loop itself is read by the loop's own ``epoll``: a
round trip of one small message each way between two processes took 0.27-0.30 ms p50 this way
against 0.58-0.62 ms over a grpc.aio stream (docs/gateway.md, *The stream transport*). The router's
hop to a worker is on every request's path to its first token, so the router reaches every worker
this way (a gRPC GenerateMux call carrying the same messages measured +1.45-1.57 ms added TTFT on
the real model against this transport's +1.21-1.25 ms, and was removed).

Wire format (both directions): frames of a 4-byte big-endian length and that many bytes. The
client's first frame is the hello, ``MAGIC`` followed by the internal token; the worker answers one
frame, empty when it accepts and a one-sentence reason when it refuses (then it closes). After that
the client sends serialized ``MuxRequest`` messages and the worker ``MuxResponse`` messages
(protos/meshserve/internal/v1/worker.proto; services/worker/mux.py). Closing the connection is
cancelling the call: every stream on it ends. A frame longer than ``max_frame`` or a message that
does not parse ends the connection (:class:`WireError`).

This module holds only framing (:class:`FrameProtocol`) and the constants; the worker's listener is
services/worker/mux_tcp.py, the router's client services/router/balancer/stream_transport.py.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol, TypeVar

from google.protobuf.message import DecodeError

MAGIC = b"meshserve-mux/1\n"
"""Starts the client's hello frame (then the internal token, UTF-8)."""
HEADER_BYTES = 4
HELLO_TIMEOUT_S = 5.0
"""How long either side waits for the other's hello (or its answer) before closing."""


class WireError(Exception):
    """The peer broke the wire format (a frame too long, a message that does not parse)."""


class FrameProtocol(asyncio.Protocol):
    """Length-prefixed frames in and out of one connection, for one reader and one writer task.

    :meth:`read` returns the next frame's bytes, or None once the connection has ended (closed by
    either side, or broken: :attr:`error` then says why). :meth:`write` queues a frame;
    :meth:`drain` waits while the transport's buffer is over its high-water mark.
    """

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None
        self.closed = False
        self._buffer = bytearray()
        self._frames: deque[bytes] = deque()
        self._reader: asyncio.Future[None] | None = None
        self._drainer: asyncio.Future[None] | None = None
        self._paused = False
        self.on_lost: list[Callable[[], None]] = []
        """Called once the connection has ended."""

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        end = len(buffer)
        while end - start >= HEADER_BYTES:
            size = int.from_bytes(buffer[start : start + HEADER_BYTES], "big")
            if size > self.max_frame:
                self.fail(WireError(f"a frame of {size} bytes is over the {self.max_frame}-byte limit"))
                return
            if end - start - HEADER_BYTES < size:
                break
            start += HEADER_BYTES
            self._frames.append(bytes(buffer[start : start + size]))
            start += size
        if start:
            del buffer[:start]
            _wake(self._reader)

    def eof_received(self) -> bool:
        return False  # a half-close ends the connection: the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is not None and self.error is None:
            self.error = exc
        _wake(self._reader)
        _wake(self._drainer)
        for callback in self.on_lost:
            callback()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        _wake(self._drainer)

    # frames

    async def read(self) -> bytes | None:
        while not self._frames:
            if self.closed:
                return None
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        return self._frames.popleft()

    def write(self, payload: bytes) -> None:
        if self.closed or self.transport is None:
            raise ConnectionResetError("the connection has ended")
        self.transport.write(len(payload).to_bytes(HEADER_BYTES, "big") + payload)

    async def drain(self) -> None:
        while self._paused and not self.closed:
            self._drainer = asyncio.get_running_loop().create_future()
            try:
                await self._drainer
            finally:
                self._drainer = None
        if self.closed:
            raise ConnectionResetError("the connection has ended")

    def fail(self, error: BaseException) -> None:
        """End the connection because of ``error`` (kept in :attr:`error`)."""
        if self.error is None:
            self.error = error
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        elif self.transport is None:
            self.connection_lost(None)


class _Parsed(Protocol):
    @classmethod
    def FromString(cls, data: bytes) -> _Parsed: ...


M = TypeVar("M", bound=_Parsed)


async def messages(protocol: FrameProtocol, kind: type[M]) -> AsyncIterator[M]:
    """The frames of ``protocol`` parsed as ``kind`` until the connection ends; a frame that does not
    parse ends the connection (:class:`WireError` in ``protocol.error``) and the iteration."""
    while (payload := await protocol.read()) is not None:
        try:
            message = kind.FromString(payload)
        except DecodeError:
            protocol.fail(WireError(f"a frame that is not a {kind.__name__}"))
            return
        yield message  # type: ignore[misc]


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)
