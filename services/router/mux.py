"""Router side of ``Worker.GenerateMux``: one long-lived call per worker carries every request's stream.

Opening a gRPC call costs the router and the worker far more than sending a message (most of a hop's
time to the first token: docs/benchmarks/hops.md), so :class:`MuxChannel` keeps one GenerateMux call
per worker replica, opened on first use and again after it fails, and :class:`MuxStream` gives each
request a stream on it with the surface of a ``Worker.Generate`` call that
:class:`~services.router.worker_stream.WorkerStream` uses (``write``, ``read`` -> frame or
``grpc.aio.EOF``, ``done_writing``, ``cancel``). A stream's failures are the ``AioRpcError`` its call
would have raised: the status the worker sent in its ``MuxEnd``, or the whole call's status when the
call breaks (the worker died: every stream on it fails, and the router resumes each elsewhere).

Frames of all streams queued while a write was in flight leave as one message. Per stream, frames
arrive in order; the worker bounds the streams per call (services/worker/mux.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import grpc
import structlog

from services.common import metadata as md
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.serving import MAX_MESSAGE_BYTES
from services.router.mux_tcp import StreamMuxCall

log = structlog.get_logger(__name__)
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def _error(code: grpc.StatusCode, details: str, retry_after_ms: int = 0) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((md.RETRY_AFTER_MS, str(retry_after_ms))) if retry_after_ms else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)


class MuxStream:
    """One request's stream on a :class:`MuxChannel`, used like a ``Worker.Generate`` call."""

    def __init__(self, channel: MuxChannel, sid: int, opened: worker_pb2.MuxOpen) -> None:
        self._channel = channel
        self._sid = sid
        self._open: worker_pb2.MuxOpen | None = opened  # sent with the first frame
        self._frames: deque[worker_pb2.WorkerResponse] = deque()
        self._ended: grpc.aio.AioRpcError | object | None = None  # EOF or the error, once the stream ended
        self._waiter: asyncio.Future[None] | None = None
        self._cancelled = False

    def _send(self, up: worker_pb2.MuxUp) -> None:
        if self._open is not None:
            up.open.CopyFrom(self._open)
            self._open = None
        self._channel.send(up)

    async def write(self, request: worker_pb2.WorkerRequest) -> None:
        if self._ended is not None or self._cancelled:
            if isinstance(self._ended, grpc.aio.AioRpcError):
                raise self._ended
            raise grpc.aio.UsageError("the worker stream has ended")
        self._send(worker_pb2.MuxUp(stream=self._sid, request=request))

    async def done_writing(self) -> None:
        if self._ended is None and not self._cancelled and self._open is None:
            self._send(worker_pb2.MuxUp(stream=self._sid, half_close=True))

    def cancel(self) -> bool:
        """Stop the stream: the worker cancels its turn at once (like cancelling a call)."""
        if self._cancelled:
            return False
        self._cancelled = True
        if self._ended is None and self._open is None:  # opened on the worker and still running there
            self._channel.send(worker_pb2.MuxUp(stream=self._sid, abort=True))
        self._channel.forget(self._sid)
        self.end(_error(grpc.StatusCode.CANCELLED, "the worker stream was cancelled"))
        return True

    async def read(self) -> worker_pb2.WorkerResponse | object:
        """The next frame, ``grpc.aio.EOF`` after the last one, or the stream's error."""
        while not self._frames:
            if self._ended is not None:
                if isinstance(self._ended, grpc.aio.AioRpcError):
                    raise self._ended
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._frames.popleft()

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
                self.end(grpc.aio.EOF)
            else:
                code = _STATUS.get(end.code, grpc.StatusCode.UNKNOWN)
                self.end(_error(code, end.message, end.retry_after_ms))
            return
        self._wake()

    def end(self, how: grpc.aio.AioRpcError | object) -> None:
        if self._ended is None:
            self._ended = how
        self._wake()


class MuxChannel:
    """The GenerateMux call of one worker replica, shared by all the router's streams to it."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, internal_token: str) -> None:
        self._stub = stub
        self._token = internal_token
        self._metadata = ((md.INTERNAL_TOKEN, internal_token),)
        self._stream_address: tuple[str, int] | None = None
        """The worker's stream transport (host, port), used instead of gRPC for the next call (mux_tcp.py)."""
        self._refused: tuple[str, int] | None = None
        self._call: grpc.aio.StreamStreamCall | StreamMuxCall | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._streams: dict[int, MuxStream] = {}
        self._next = 0
        self._out: list[worker_pb2.MuxUp] = []
        self._out_ready = asyncio.Event()
        self._retiring = False
        self.unsupported = False
        """The worker answered UNIMPLEMENTED (it predates GenerateMux): use Generate calls instead."""

    def offer_stream(self, address: tuple[str, int] | None) -> None:
        """The worker's stream transport as it last announced it (None: none, or not to be used).
        The next call goes there, unless that address has refused the router already."""
        self._stream_address = address if address != self._refused else None

    def open(self, metadata: tuple[tuple[str, str], ...], timeout: float | None) -> MuxStream:
        """A new stream; ``metadata`` is what the Generate call would carry (request id, tenant, trace)."""
        if self._call is None:
            self._connect()
        meta = dict(metadata)
        opened = worker_pb2.MuxOpen(
            request_id=meta.get(md.REQUEST_ID, ""),
            tenant=meta.get(md.TENANT, ""),
            traceparent=meta.get("traceparent", ""),
            timeout_ms=max(1, round(timeout * 1000)) if timeout is not None else 0,
        )
        self._next += 1
        stream = MuxStream(self, self._next, opened)
        self._streams[self._next] = stream
        return stream

    def send(self, up: worker_pb2.MuxUp) -> None:
        self._out.append(up)
        self._out_ready.set()

    def forget(self, sid: int) -> None:
        self._streams.pop(sid, None)
        if self._retiring and not self._streams:
            self._hang_up()

    def retire(self) -> None:
        """The replica is leaving: end the call once its streams have ended (now if none is open)."""
        self._retiring = True
        if not self._streams:
            self._hang_up()

    def _connect(self) -> None:
        call: grpc.aio.StreamStreamCall | StreamMuxCall
        if self._stream_address is not None:
            call = StreamMuxCall(
                self._stream_address, self._token, MAX_MESSAGE_BYTES, self._grpc_call, self._stream_refused
            )
        else:
            call = self._grpc_call()
        self._call = call
        self._tasks = [asyncio.ensure_future(self._write(call)), asyncio.ensure_future(self._read(call))]

    def _grpc_call(self) -> grpc.aio.StreamStreamCall:
        return self._stub.GenerateMux(metadata=self._metadata)

    def _stream_refused(self, address: tuple[str, int]) -> None:
        self._refused = address
        if self._stream_address == address:
            self._stream_address = None

    def _hang_up(self) -> None:
        if self._call is not None:
            self._call.cancel()

    async def _write(self, call: grpc.aio.StreamStreamCall | StreamMuxCall) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            while True:
                if not self._out:
                    self._out_ready.clear()
                    await self._out_ready.wait()
                    continue
                frames, self._out = self._out, []
                await call.write(worker_pb2.MuxRequest(frames=frames))

    async def _read(self, call: grpc.aio.StreamStreamCall | StreamMuxCall) -> None:
        error = _error(grpc.StatusCode.UNAVAILABLE, "the worker ended its stream multiplex")
        try:
            async for message in call:
                for down in message.frames:
                    stream = self._streams.get(down.stream)
                    if stream is not None:
                        stream.deliver(down)
                        if down.HasField("end"):
                            self.forget(down.stream)
        except grpc.aio.AioRpcError as exc:
            error = exc
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older worker: Generate calls from now on
                self.unsupported = True
                error = _error(grpc.StatusCode.UNAVAILABLE, "the worker does not serve GenerateMux; retry")
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.info("worker_mux_failed", code=exc.code().name, streams=len(self._streams))
        finally:
            # Every stream still open on this call fails as its own call would have; the next open
            # starts a new call.
            if self._call is call:
                self._call = None
                self._out = []
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
