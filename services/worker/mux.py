"""Worker side of the stream transport's multiplexing: many Generate streams on one connection.

A call or a connection costs both ends far more than a message does (the router's call setup and
the worker's handler setup were most of a hop's time to the first token: docs/benchmarks/hops.md),
so the router keeps one connection per worker (services/worker/mux_tcp.py serves it) and opens
each request's stream as a message on it (a "call" below: one connection's ``MuxRequest`` messages
in, ``MuxResponse`` messages out). Each stream runs the servicer's own ``Generate`` (same turns,
cancels, chat sessions, frames) in a task of its own, with what a gRPC call would carry (request id
and tenant for logs, trace parent, deadline) taken from its ``MuxOpen``; its end is sent as a
``MuxEnd`` carrying the status a Generate call would have ended with. Frames ready at the same time,
of any streams, leave as one message.

Bounds: at most ``max_streams`` streams per call (more are refused with RESOURCE_EXHAUSTED); a
stream's frames are bounded by its turns' ``max_tokens``; a stream with :data:`MAX_UNREAD` frames from
the router not yet taken by its handler is ended with RESOURCE_EXHAUSTED (one call carries every
stream, so flow control cannot hold back one stream's frames). The call's end (router gone, or cancelled)
cancels every stream, as cancelled Generate calls would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import structlog

from services.common import metadata as md
from services.common import tracing
from services.common.errors import MeshError, ResourceExhausted
from services.common.interceptors import status_for
from services.common.pb.meshserve.internal.v1 import worker_pb2

log = structlog.get_logger(__name__)

Generate = Callable[[AsyncIterator[worker_pb2.WorkerRequest]], AsyncIterator[worker_pb2.WorkerResponse]]
"""A stream's turn logic: its router frames in, its worker frames out; a failure is a domain error
(services/common/errors.py), sent as the stream's status."""
METHOD = "/meshserve.internal.v1.Worker/Generate"
_CLOSE = None
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
MAX_UNREAD = 64
"""Frames of one stream the router may send ahead of its handler (it sends a start, then waits)."""


@dataclass(eq=False)
class _Stream:
    inbox: asyncio.Queue[worker_pb2.WorkerRequest | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    refused: bool = False
    """Ended for sending more than MAX_UNREAD frames ahead; its further frames are dropped."""


def _end(code: grpc.StatusCode, message: str, retry_after_ms: int = 0) -> worker_pb2.MuxEnd:
    return worker_pb2.MuxEnd(code=code.value[0], message=message, retry_after_ms=retry_after_ms)


class _Call:
    """One multiplexed call (a connection): its streams and its outgoing frames."""

    def __init__(
        self,
        generate: Generate,
        max_streams: int,
        draining: Callable[[], bool],
        hold: Callable[[int], None] = lambda ttl_ms: None,
    ) -> None:
        self._generate = generate
        self._max_streams = max_streams
        self.draining = draining
        self._hold = hold
        self.streams: dict[int, _Stream] = {}
        self.out: deque[worker_pb2.MuxDown] = deque()
        self.wake = asyncio.Event()
        self.reading = True

    def push(self, frame: worker_pb2.MuxDown) -> None:
        self.out.append(frame)
        self.wake.set()

    async def read(self, request_iterator: AsyncIterator[worker_pb2.MuxRequest]) -> None:
        try:
            async for message in request_iterator:
                if message.HasField("background_hold"):
                    self._hold(message.background_hold.ttl_ms)
                for up in message.frames:
                    self._dispatch(up)
        except Exception as exc:  # the call ended under us (cancelled, reset): as if the router closed it
            log.debug("worker_mux_read_ended", error=type(exc).__name__)
        finally:
            self.reading = False
            self.wake.set()

    def _dispatch(self, up: worker_pb2.MuxUp) -> None:
        kind = up.WhichOneof("kind")
        if kind == "open":
            if up.stream in self.streams:
                in_use = _end(grpc.StatusCode.INVALID_ARGUMENT, "stream id in use")
                self.push(worker_pb2.MuxDown(stream=up.stream, end=in_use))
                return
            if self.draining():  # as a stopping server refuses new calls: the router retries elsewhere
                leaving = _end(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down; retry on another worker")
                self.push(worker_pb2.MuxDown(stream=up.stream, end=leaving))
                return
            if len(self.streams) >= self._max_streams:
                busy = _end(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams on this call", 100)
                self.push(worker_pb2.MuxDown(stream=up.stream, end=busy))
                return
            stream = _Stream()
            self.streams[up.stream] = stream
            stream.task = asyncio.get_running_loop().create_task(self._run(up.stream, stream, up.open))
        stream_or_none = self.streams.get(up.stream)
        if stream_or_none is None:
            return  # a frame for a stream that has ended: nothing to do
        if stream_or_none.refused:
            return
        if stream_or_none.inbox.qsize() >= MAX_UNREAD and stream_or_none.task is not None:
            stream_or_none.refused = True
            stream_or_none.task.cancel()
            return
        if up.HasField("request"):
            stream_or_none.inbox.put_nowait(up.request)
        if kind == "half_close":
            stream_or_none.inbox.put_nowait(_CLOSE)
        elif kind == "abort" and stream_or_none.task is not None:
            stream_or_none.task.cancel()

    async def _requests(self, stream: _Stream) -> AsyncIterator[worker_pb2.WorkerRequest]:
        while (request := await stream.inbox.get()) is not _CLOSE:
            yield request

    async def _run(self, sid: int, stream: _Stream, opened: worker_pb2.MuxOpen) -> None:
        # This task's context only: the stream's request id, tenant and trace, like a call's.
        structlog.contextvars.bind_contextvars(request_id=opened.request_id, tenant=opened.tenant, rpc=METHOD)
        span = None
        if tracing.enabled():
            carrier = {md.REQUEST_ID: opened.request_id, md.TENANT: opened.tenant, "traceparent": opened.traceparent}
            span = tracing.start_server_span(METHOD.lstrip("/"), carrier.items())  # named like the call's span
        end: worker_pb2.MuxEnd | None = worker_pb2.MuxEnd()
        try:
            async with asyncio.timeout(opened.timeout_ms / 1000 if opened.timeout_ms else None):
                frames_of = self._generate(self._requests(stream))
                async with aclosing(frames_of) as frames:  # type: ignore[type-var]
                    async for frame in frames:
                        self.push(worker_pb2.MuxDown(stream=sid, response=frame))
        except asyncio.CancelledError:
            end = None  # aborted by the router, or the call ended: nobody waits for an end frame
            if stream.refused:
                ahead = f"more than {MAX_UNREAD} frames sent ahead on one stream"
                end = _end(grpc.StatusCode.RESOURCE_EXHAUSTED, ahead)
        except TimeoutError:
            end = _end(grpc.StatusCode.DEADLINE_EXCEEDED, "the stream's deadline passed")
        except MeshError as exc:
            retry = exc.retry_after_ms if isinstance(exc, ResourceExhausted) else 0
            end = _end(status_for(exc), exc.message, retry)
        except Exception as exc:
            log.error("internal_error", exc_info=exc)
            end = _end(grpc.StatusCode.INTERNAL, "internal error; the server log has the details")
        finally:
            if span is not None:
                if end is not None and end.code:
                    tracing.record_error(span, RuntimeError(end.message), _STATUS_NAMES.get(end.code, "UNKNOWN"))
                span.end()
            self.streams.pop(sid, None)
            if end is not None:
                self.push(worker_pb2.MuxDown(stream=sid, end=end))
            self.wake.set()  # the call may be over now (see serve_mux)

    async def close(self) -> None:
        tasks = [s.task for s in self.streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class MuxCalls:
    """The multiplexed calls a worker serves, so a drain reaches them all (see :func:`serve_mux`), and
    the host's foreground flag their routers send (``MuxRequest.background_hold``).

    ``hold``: the engine's ``hold_background(until)`` (``services.worker.types``; None: the engine has
    no background sequences and the flag is ignored). Each call (one router's connection) holds until
    its latest flag expires or it sends 0 or it ends; the engine holds until the latest of them.
    """

    def __init__(self, hold: Callable[[float], None] | None = None) -> None:
        self.draining = False
        self._calls: set[_Call] = set()
        self._hold = hold
        self._holds: dict[_Call, float] = {}

    def hold(self, call: _Call, ttl_ms: int) -> None:
        """``call``'s router set (``ttl_ms`` > 0, from now) or cleared (0) its flag."""
        if self._hold is None:
            return
        if ttl_ms:
            self._holds[call] = time.monotonic() + ttl_ms / 1000
        elif self._holds.pop(call, None) is None:
            return
        self._hold(max(self._holds.values(), default=0.0))

    def drain(self) -> None:
        """New streams are refused from now on; each call ends once its running streams have ended."""
        self.draining = True
        for call in self._calls:
            call.wake.set()


async def serve_mux(
    generate: Generate,
    request_iterator: AsyncIterator[worker_pb2.MuxRequest],
    *,
    max_streams: int = 4096,
    calls: MuxCalls | None = None,
) -> AsyncIterator[worker_pb2.MuxResponse]:
    """The frames of one multiplexed call (see the module docstring).

    With ``calls``, a drain (``calls.drain()``, when the worker stops) refuses new streams with
    UNAVAILABLE and ends the call as soon as its streams have ended, so a stopping server is not
    held for its whole grace period by a call that never ends by itself.
    """
    calls = calls or MuxCalls()
    call = _Call(generate, max_streams, lambda: calls.draining, lambda ttl_ms: calls.hold(call, ttl_ms))
    calls._calls.add(call)
    reader = asyncio.create_task(call.read(request_iterator))
    try:
        while True:
            if not call.out:
                if (not call.reading or calls.draining) and not call.streams:
                    return  # the router is done writing (or the worker drains) and every stream has ended
                call.wake.clear()
                await call.wake.wait()
                continue
            frames = list(call.out)
            call.out.clear()
            yield worker_pb2.MuxResponse(frames=frames)
    finally:
        calls._calls.discard(call)
        calls.hold(call, 0)  # a router gone takes its flag with it
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await call.close()
