"""The router's worker transport: every stream to a worker over one plain TCP connection to it.

Wire format and why TCP rather than gRPC: services/common/muxwire.py (grpc.aio hands each message
through three threads; a connection served by the event loop itself is about 0.3 ms faster per
request to its first token: docs/gateway.md, *The stream transport*); the worker's side is
services/worker/mux_tcp.py. This module is the one place where the router's domain turns
(services/router/balancer/worker_stream.py) become wire messages and back.

:class:`StreamTransport` keeps one :class:`_Link` per worker address: a connection to the port the
worker last announced (``WorkerStats.stream_port``), opened by the first stream, again by the first
stream after it ended, and ended with its last stream once the replica leaves (:meth:`retire`). Each
request's stream (:class:`TcpWorkerStream`) is opened by a message on it (``MuxOpen``: request id,
tenant, traceparent, deadline), so a request costs the router and the worker a message, not a
connection or a call. Frames of all streams queued while a write was in flight leave as one
message; per stream, frames arrive in order; the worker bounds the streams per connection.

Failures are :class:`~services.router.balancer.worker_stream.WorkerFailed`: a stream the worker ends with a
status fails with it (``MuxEnd``); when the connection cannot be opened (nothing listens on the
port, the worker refuses the internal credential), breaks, or is ended by the worker (it drains),
every stream on it fails with UNAVAILABLE, and so does a stream to a worker that announces no port:
the router ejects that worker and retries or resumes elsewhere, as for any worker failure.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

import grpc
import structlog

from services.common import logprobs_pb, sampling_pb
from services.common import metadata as md
from services.common.generation import QUEUED, Final, FinishReason, GenerationEvent, GenerationRequest
from services.common.interceptors import outbound_metadata
from services.common.muxwire import HELLO_TIMEOUT_S, MAGIC, FrameProtocol, messages
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.serving import MAX_MESSAGE_BYTES
from services.common.status_errors import Upstream, from_status, status_code
from services.router.balancer.registry import Replica
from services.router.balancer.worker_stream import WorkerClosed, WorkerFailed

log = structlog.get_logger(__name__)
Address = tuple[str, int]
_EOF = object()
"""A stream's end without a status (the worker's MuxEnd said OK)."""


def _failure(code: grpc.StatusCode, detail: str, retry_after_ms: int = 0) -> WorkerFailed:
    error = from_status(code, detail, Upstream.WORKER, retry_after_ms or md.DEFAULT_RETRY_AFTER_MS)
    return WorkerFailed(code.name, error, detail)


def split_host(address: str) -> str:
    """The host of a ``host:port`` address (IPv6 brackets kept off)."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _start_pb(start: GenerationRequest) -> worker_pb2.WorkerStart:
    return worker_pb2.WorkerStart(
        request_id=start.request_id,
        prompt_token_ids=start.prompt_ids,
        sampling=sampling_pb.to_pb(start.sampling),
        tenant=start.tenant,
        resume_token_ids=start.resume_ids,
        shareable_prefix=start.shareable,
        priority=start.priority,
        background=start.background,
    )


def _frame(r: worker_pb2.WorkerResponse) -> GenerationEvent:
    if r.queued:
        return QUEUED
    if not r.HasField("final"):
        logprobs = logprobs_pb.from_pb(r.logprobs) if r.logprobs else ()
        return GenerationEvent(tuple(r.token_ids), r.text, r.index, logprobs, sequence=r.sequence)
    f = r.final
    reason = FinishReason(f.finish_reason or FinishReason.STOP)
    final = Final(reason, f.prompt_tokens, f.completion_tokens, f.prefill_tokens, f.budget_closed)
    return GenerationEvent(tuple(r.token_ids), r.text, r.index, final=final, sequence=r.sequence)


class TcpWorkerStream:
    """One request's (or chat's) stream on a worker's connection (a WorkerStream)."""

    def __init__(self, replica: Replica, link: _Link | None, sid: int, opened: worker_pb2.MuxOpen) -> None:
        self.replica = replica
        self._link = link
        self._sid = sid
        self._open: worker_pb2.MuxOpen | None = opened  # sent with the first frame
        self._frames: deque[worker_pb2.WorkerResponse] = deque()
        self._ended: WorkerFailed | object | None = None  # _EOF or the failure, once the stream ended
        self._waiter: asyncio.Future[None] | None = None
        self._cancelled = False

    def _send(self, up: worker_pb2.MuxUp) -> None:
        if self._open is not None:
            up.open.CopyFrom(self._open)
            self._open = None
        assert self._link is not None
        self._link.send(up)

    def _write(self, request: worker_pb2.WorkerRequest) -> None:
        if self._ended is not None:
            if isinstance(self._ended, WorkerFailed):
                raise self._ended
            raise WorkerClosed("the worker ended the stream")
        self._send(worker_pb2.MuxUp(stream=self._sid, request=request))

    async def start(self, start: GenerationRequest) -> None:
        self._write(worker_pb2.WorkerRequest(start=_start_pb(start)))

    async def cancel_turn(self) -> None:
        self._write(worker_pb2.WorkerRequest(cancel=worker_pb2.WorkerCancel()))

    async def read(self) -> GenerationEvent:
        while not self._frames:
            if self._ended is not None:
                if isinstance(self._ended, WorkerFailed):
                    raise self._ended
                raise WorkerClosed("worker closed the stream in the middle of a turn")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return _frame(self._frames.popleft())

    def abort(self) -> None:
        """Stop the stream: one ``abort`` frame, and the worker cancels its turn at once."""
        if self._cancelled:
            return
        self._cancelled = True
        if self._ended is None and self._open is None and self._link is not None:  # running on the worker
            self._link.send(worker_pb2.MuxUp(stream=self._sid, abort=True))
        if self._link is not None:
            self._link.forget(self._sid)
        self.end(_failure(grpc.StatusCode.CANCELLED, "the worker stream was cancelled"))

    async def close(self) -> None:
        self.abort()  # one abort frame ends it on the worker (a half-close would be one write more)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def deliver(self, down: worker_pb2.MuxDown) -> None:
        if self._ended is not None:
            return
        if down.HasField("response"):
            self._frames.append(down.response)
        else:
            end = down.end
            if end.code == 0:
                self.end(_EOF)
            else:
                self.end(_failure(status_code(end.code), end.message, end.retry_after_ms))
            return
        self._wake()

    def end(self, how: WorkerFailed | object) -> None:
        if self._ended is None:
            self._ended = how
        self._wake()


class StreamConnection:
    """One TCP connection to a worker's stream port: connect and hello in the background, then
    ``MuxRequest`` out (:meth:`write`) and ``MuxResponse`` in (iterate); failures are WorkerFailed."""

    def __init__(self, address: Address, internal_token: str, max_frame: int) -> None:
        self._where = f"{address[0]}:{address[1]}"
        self._protocol: FrameProtocol | None = None
        self._cancelled = False
        self._ready = asyncio.ensure_future(self._open(address, internal_token.encode(), max_frame))
        self._ready.add_done_callback(_retrieve)

    async def _open(self, address: Address, token: bytes, max_frame: int) -> FrameProtocol | None:
        loop = asyncio.get_running_loop()
        protocol: FrameProtocol | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                _, protocol = await loop.create_connection(lambda: FrameProtocol(max_frame), *address)
                protocol.write(MAGIC + token)
                answer = await protocol.read()
            reason = "it closed the connection" if answer is None else answer.decode(errors="replace")
        except (OSError, TimeoutError) as exc:
            answer, reason = None, str(exc) or type(exc).__name__
        if answer == b"" and protocol is not None:
            self._protocol = protocol
            if self._cancelled:
                protocol.close()
            return protocol
        if protocol is not None:
            protocol.close()
        if self._cancelled:
            return None
        log.warning("worker_stream_port_unusable", address=self._where, reason=reason)
        raise _failure(grpc.StatusCode.UNAVAILABLE, f"cannot use the worker's stream port {self._where}: {reason}")

    async def _connection(self) -> FrameProtocol | None:
        return self._protocol if self._protocol is not None else await self._ready

    async def write(self, message: worker_pb2.MuxRequest) -> None:
        protocol = await self._connection()
        if protocol is None:
            raise _failure(grpc.StatusCode.CANCELLED, "the connection was closed")
        try:
            protocol.write(message.SerializeToString())
            await protocol.drain()
        except ConnectionError:
            raise _failure(
                grpc.StatusCode.UNAVAILABLE, f"the connection to the worker's stream port {self._where} ended"
            ) from None

    def __aiter__(self) -> AsyncIterator[worker_pb2.MuxResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[worker_pb2.MuxResponse]:
        protocol = await self._connection()
        if protocol is None:
            raise _failure(grpc.StatusCode.CANCELLED, "the connection was closed")
        async for message in messages(protocol, worker_pb2.MuxResponse):
            yield message
        if self._cancelled:
            raise _failure(grpc.StatusCode.CANCELLED, "the connection was closed")
        if protocol.error is not None:
            raise _failure(
                grpc.StatusCode.UNAVAILABLE,
                f"the connection to the worker's stream port {self._where} broke: {protocol.error}",
            )
        # A clean end: the worker ended the connection (it drains); _Link fails what is left.

    def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        if self._protocol is not None:
            self._protocol.close()


def _retrieve(future: asyncio.Future[FrameProtocol | None]) -> None:
    if not future.cancelled():
        future.exception()


class _Link:
    """The router's connection to one worker, shared by all its streams to that worker; reopened by
    the first stream after it ended."""

    def __init__(self, internal_token: str, max_frame: int) -> None:
        self._token = internal_token
        self._max_frame = max_frame
        self._call: StreamConnection | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._streams: dict[int, TcpWorkerStream] = {}
        self._next = 0
        self._out: list[worker_pb2.MuxUp] = []
        self._out_ready = asyncio.Event()
        self._hold: int | None = (
            None  # the host flag to send with the next message (services/router/balancer/host_hold.py)
        )
        self._retiring = False

    def open(self, replica: Replica, address: Address, opened: worker_pb2.MuxOpen) -> TcpWorkerStream:
        """A new stream; ``address``: the worker's stream port as last announced, used when connecting."""
        if self._call is None:
            self._connect(address)
        self._next += 1
        stream = TcpWorkerStream(replica, self, self._next, opened)
        self._streams[self._next] = stream
        return stream

    def send(self, up: worker_pb2.MuxUp) -> None:
        self._out.append(up)
        self._out_ready.set()

    def hold(self, ttl_ms: int) -> None:
        """Send the host's foreground flag with the next message; dropped while not connected (no
        connection: no stream of this router runs on the worker)."""
        if self._call is None:
            return
        self._hold = ttl_ms
        self._out_ready.set()

    def forget(self, sid: int) -> None:
        self._streams.pop(sid, None)
        if self._retiring and not self._streams:
            self._hang_up()

    def retire(self) -> None:
        """The replica is leaving: end the connection once its streams have ended (now if none is open)."""
        self._retiring = True
        if not self._streams:
            self._hang_up()

    def _connect(self, address: Address) -> None:
        call = StreamConnection(address, self._token, self._max_frame)
        self._call = call
        self._tasks = [asyncio.ensure_future(self._write(call)), asyncio.ensure_future(self._read(call))]

    def _hang_up(self) -> None:
        if self._call is not None:
            self._call.cancel()

    async def _write(self, call: StreamConnection) -> None:
        with contextlib.suppress(WorkerFailed, asyncio.InvalidStateError):
            while True:
                if not self._out and self._hold is None:
                    self._out_ready.clear()
                    await self._out_ready.wait()
                    continue
                frames, self._out = self._out, []
                hold, self._hold = self._hold, None
                message = worker_pb2.MuxRequest(frames=frames)
                if hold is not None:
                    message.background_hold.CopyFrom(worker_pb2.BackgroundHold(ttl_ms=hold))
                await call.write(message)

    async def _read(self, call: StreamConnection) -> None:
        error = _failure(grpc.StatusCode.UNAVAILABLE, "the worker ended its stream connection")
        try:
            async for message in call:
                for down in message.frames:
                    stream = self._streams.get(down.stream)
                    if stream is not None:
                        stream.deliver(down)
                        if down.HasField("end"):
                            self.forget(down.stream)
        except WorkerFailed as exc:
            error = exc
            if exc.code != "CANCELLED":
                log.info("worker_connection_failed", code=exc.code, detail=str(exc), streams=len(self._streams))
        finally:
            # Every stream still open on this connection fails; the next open starts a new one.
            if self._call is call:
                self._call = None
                self._out = []
                self._hold = None
            failed, self._streams = self._streams, {}
            for stream in failed.values():
                stream.end(error)
            for task in self._tasks:
                if task is not asyncio.current_task():
                    task.cancel()

    async def close(self) -> None:
        self._hang_up()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class StreamTransport:
    """The router's WorkerTransport over the workers' stream ports (see the module docstring)."""

    def __init__(self, internal_token: str, max_frame: int = MAX_MESSAGE_BYTES) -> None:
        self._token = internal_token
        self._max_frame = max_frame
        self._links: dict[str, _Link] = {}

    def open(self, replica: Replica, timeout: float | None) -> TcpWorkerStream:
        meta = dict(outbound_metadata(""))  # the caller's request id, tenant and trace context
        opened = worker_pb2.MuxOpen(
            request_id=meta.get(md.REQUEST_ID, ""),
            tenant=meta.get(md.TENANT, ""),
            traceparent=meta.get("traceparent", ""),
            timeout_ms=max(1, round(timeout * 1000)) if timeout is not None else 0,
        )
        port = replica.report.stream_port
        if not port:
            log.warning("worker_without_stream_port", worker=replica.name, address=replica.address)
            stream = TcpWorkerStream(replica, None, 0, opened)
            stream.end(_failure(grpc.StatusCode.UNAVAILABLE, f"worker {replica.name} announces no stream port"))
            return stream
        link = self._links.get(replica.address)
        if link is None:
            link = self._links[replica.address] = _Link(self._token, self._max_frame)
        return link.open(replica, (split_host(replica.address), port), opened)

    def hold_background(self, address: str, ttl_ms: int) -> None:
        """The host's foreground flag for the worker at ``address`` (services/router/balancer/host_hold.py), on
        this router's connection to it; nothing when there is none."""
        link = self._links.get(address)
        if link is not None:
            link.hold(ttl_ms)

    def retire(self, address: str) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.retire()

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.close()
