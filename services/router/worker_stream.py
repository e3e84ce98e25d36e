"""One open ``Worker.Generate`` bidi call, and the mapping of worker status codes to domain errors."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc

from services.common import errors
from services.common import metadata as md
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.router.mux import MuxChannel, MuxStream
from services.router.mux_tcp import split_host
from services.router.registry import Replica

# Failures before the first token that another replica may not have: retried elsewhere.
RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})
# Failures after tokens were sent that another replica can continue from (the worker died/stalled).
RESUMABLE = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN"})


class WorkerClosed(Exception):
    """The worker ended the stream without a final frame, or broke the frame sequence."""


class WorkerStalled(WorkerClosed):
    """The worker sent nothing for longer than the stall timeout."""


WorkerCallError = grpc.aio.AioRpcError
"""What a failed worker call raises (a status from the worker or its transport)."""
WORKER_FAILURES = (WorkerCallError, WorkerClosed)
"""Every way a worker stream can fail under the router (see :func:`failure_code`)."""


def failure_code(exc: BaseException) -> str:
    """The status name of a worker failure: the call's status, UNAVAILABLE for a stream that closed
    or stalled (the worker is gone, as far as the router can tell)."""
    return exc.code().name if isinstance(exc, WorkerCallError) else "UNAVAILABLE"


def worker_error(exc: BaseException) -> errors.MeshError | None:
    """The domain error for a worker failure that carried a status; None for a closed/stalled stream."""
    return domain_error(exc) if isinstance(exc, WorkerCallError) else None


class WorkerStream:
    """A Worker.Generate call, or a stream of the replica's GenerateMux call (``mux``): write
    starts/cancels, read frames. Lives for one request or chat."""

    def __init__(
        self,
        replica: Replica,
        metadata: tuple[tuple[str, str], ...],
        timeout: float | None,
        *,
        mux: bool = True,
        stream_transport: bool = True,
    ) -> None:
        self.replica = replica
        self.call: grpc.aio.StreamStreamCall | MuxStream
        if mux and replica.report.mux and not (replica.mux is not None and replica.mux.unsupported):
            # a stream on the replica's long-lived GenerateMux call (services/router/mux.py)
            port = replica.report.stream_port if stream_transport else 0
            where = (split_host(replica.address), port) if port else None
            if replica.mux is None:
                replica.mux = MuxChannel(replica.stub, dict(metadata).get(md.INTERNAL_TOKEN, ""))
            replica.mux.offer_stream(where)  # the port last announced (a restarted worker has a new one)
            self.call = replica.mux.open(metadata, timeout)
        else:
            self.call = replica.stub.Generate(metadata=metadata, timeout=timeout)

    async def start(self, start: worker_pb2.WorkerStart) -> None:
        await self.call.write(worker_pb2.WorkerRequest(start=start))

    async def cancel_turn(self) -> None:
        """Ask the worker to end the turn in progress (it answers with a CANCELLED final frame)."""
        await self.call.write(worker_pb2.WorkerRequest(cancel=worker_pb2.WorkerCancel()))

    async def read(self) -> worker_pb2.WorkerResponse:
        frame = await self.call.read()
        if frame is grpc.aio.EOF:
            raise WorkerClosed("worker closed the stream in the middle of a turn")
        assert isinstance(frame, worker_pb2.WorkerResponse)
        return frame

    def abort(self) -> None:
        """Cancel the call: the worker stops generating at once."""
        self.call.cancel()

    async def close(self) -> None:
        """Half-close, then cancel whatever is left."""
        if isinstance(self.call, MuxStream):  # one abort frame does both (and one frame is one write less)
            self.call.cancel()
            return
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
            await self.call.done_writing()
        self.call.cancel()


def domain_error(exc: grpc.aio.AioRpcError) -> errors.MeshError:
    """The domain error to raise to our caller for a worker status (worker text is not passed on)."""
    code = exc.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return errors.ResourceExhausted(
            "the workers are overloaded; retry shortly", md.retry_after_ms(exc.trailing_metadata())
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExceeded("the request's deadline passed before generation finished")
    if code == grpc.StatusCode.CANCELLED:
        return errors.Cancelled("the generation was cancelled")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument("the worker rejected the request's parameters; check them against ListModels")
    return errors.Unavailable("the worker serving this request failed; retry the request")


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def read_or_cancel(stream: WorkerStream, cancel: asyncio.Event) -> tuple[worker_pb2.WorkerResponse, bool]:
    """The next frame; if ``cancel`` fires first, send WorkerCancel and keep reading."""
    if cancel.is_set():
        await stream.cancel_turn()
        return await stream.read(), True
    read = asyncio.ensure_future(stream.read())
    # If our caller is cancelled (or cancel_turn fails) after ``read`` failed, nobody awaits it:
    # retrieve its exception here so asyncio does not log it as "never retrieved".
    read.add_done_callback(_retrieve)
    waiter = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait({read, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        read.cancel()
        raise
    finally:
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
    sent = False
    if cancel.is_set():
        await stream.cancel_turn()
        sent = True
    return await read, sent


async def read_frame(
    stream: WorkerStream, cancel: asyncio.Event | None, cancel_sent: bool, stall_s: float
) -> tuple[worker_pb2.WorkerResponse, bool]:
    """The next frame within ``stall_s`` (else WorkerStalled), sending WorkerCancel once ``cancel`` fires.

    Returns the frame and whether the cancel has been sent.
    """
    try:
        if cancel is not None and not cancel_sent:
            return await asyncio.wait_for(read_or_cancel(stream, cancel), stall_s)
        # asyncio.timeout, not wait_for: wait_for wraps every read in a task of its own (an extra
        # task and loop pass per relayed frame).
        async with asyncio.timeout(stall_s):
            return await stream.read(), cancel_sent
    except TimeoutError:
        raise WorkerStalled(f"worker sent nothing for {stall_s:g} s") from None
