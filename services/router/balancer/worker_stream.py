"""How the router core talks to a worker: one interface, in domain terms, whatever carries it.

A :class:`WorkerTransport` opens a :class:`WorkerStream` on a replica for one request or chat; the
core starts turns on it (a :class:`~services.common.generation.GenerationRequest`, the worker's own
request type), may cancel the turn in progress, reads its frames (the worker's
:class:`~services.common.generation.GenerationEvent` s, numbered by ``sequence``) and closes or
aborts it. Every failure is a :class:`WorkerFailed` carrying the status name the worker (or its
connection) ended with and the domain error for the caller, so the core's retry (before the first
token) and resumption (after it) need no transport types. The one implementation is the stream
transport (services/router/balancer/stream_transport.py: plain TCP to the port each worker announces), the
fastest of the ways measured (docs/gateway.md, *The stream transport*).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from services.common import errors
from services.common.generation import GenerationEvent, GenerationRequest
from services.router.balancer.registry import Replica

# Failures before the first token that another replica may not have: retried elsewhere.
RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})
# Failures after tokens were sent that another replica can continue from (the worker died/stalled).
RESUMABLE = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN"})


class WorkerFailed(Exception):
    """A worker stream failed. ``code`` names the status it ended with (UNAVAILABLE when the worker
    or its connection went away); ``error`` is the domain error for the caller, None when the worker
    went away without a status (the stream closed, broke its sequence, or stalled)."""

    def __init__(self, code: str, error: errors.MeshError | None, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.error = error


class WorkerClosed(WorkerFailed):
    """The worker ended the stream without a final frame, or broke the frame sequence."""

    def __init__(self, detail: str) -> None:
        super().__init__("UNAVAILABLE", None, detail)


class WorkerStalled(WorkerClosed):
    """The worker sent nothing for longer than the stall timeout."""


class WorkerStream(Protocol):
    """One request's (or chat's) stream of turns on one worker replica."""

    replica: Replica

    async def start(self, start: GenerationRequest) -> None:
        """Start a turn (the next one, on a chat's stream)."""

    async def cancel_turn(self) -> None:
        """Ask the worker to end the turn in progress (it answers with a CANCELLED final frame)."""

    async def read(self) -> GenerationEvent:
        """The next frame (WorkerFailed when the stream failed or ended without one)."""
        ...

    def abort(self) -> None:
        """Stop the stream now: the worker stops generating at once; reads fail."""

    async def close(self) -> None:
        """End the stream (its turn, if one runs, is stopped)."""


class WorkerTransport(Protocol):
    """Opens worker streams and owns the connections under them."""

    def open(self, replica: Replica, timeout: float | None) -> WorkerStream:
        """A stream on ``replica`` for a request whose deadline is ``timeout`` seconds away (None: none).
        The request id, tenant and trace context of the caller's context go with it."""
        ...

    def retire(self, address: str) -> None:
        """The replica at ``address`` left: its connection ends once its streams have."""

    async def close(self) -> None:
        """End every connection (the router stops)."""


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def read_or_cancel(stream: WorkerStream, cancel: asyncio.Event) -> tuple[GenerationEvent, bool]:
    """The next frame; if ``cancel`` fires first, send the cancel and keep reading."""
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
) -> tuple[GenerationEvent, bool]:
    """The next frame within ``stall_s`` (else WorkerStalled), sending the cancel once ``cancel`` fires.

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
