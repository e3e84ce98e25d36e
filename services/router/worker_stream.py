"""How the router core talks to a worker: one interface, in domain terms, whatever carries it.

A :class:`WorkerTransport` opens a :class:`WorkerStream` on a replica for one request or chat; the
core starts turns on it (:class:`TurnStart`), may cancel the turn in progress, reads its
:class:`Frame` s and closes or aborts it. Every failure is a :class:`WorkerFailed` carrying the
status name the worker (or its connection) ended with and the domain error for the caller, so the
core's retry (before the first token) and resumption (after it) need no transport types. The one
implementation is the stream transport (services/router/stream_transport.py: plain TCP to the port
each worker announces), the fastest of the ways measured (docs/gateway.md, *The stream transport*).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.common import errors
from services.common.logprobs import TokenLogprob
from services.common.sampling import SamplingParams
from services.router.registry import Replica

# Failures before the first token that another replica may not have: retried elsewhere.
RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})
# Failures after tokens were sent that another replica can continue from (the worker died/stalled).
RESUMABLE = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN"})


@dataclass(frozen=True, slots=True)
class TurnStart:
    """One turn for a worker: the whole prompt so far; with ``resume_ids``, the tokens an earlier
    worker already sent (prefilled, never sent again)."""

    request_id: str
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    tenant: str
    resume_ids: Sequence[int] = ()
    shareable: bool = False
    priority: int = 0
    background: bool = False


@dataclass(frozen=True, slots=True)
class TurnFinal:
    """How a turn ended on the worker."""

    finish_reason: int  # meshserve.v1.FinishReason value, never unspecified
    prompt_tokens: int
    completion_tokens: int
    prefill_tokens: int


@dataclass(frozen=True, slots=True)
class Frame:
    """A worker frame: tokens and their text since the previous one, numbered from 0 per turn; a
    ``queued`` keepalive (no tokens, no number) while the turn waits or prefills; ``final`` on the last."""

    sequence: int
    token_ids: list[int]
    text: str
    queued: bool = False
    final: TurnFinal | None = None
    index: int = 0
    """The choice the frame belongs to (0 to n-1 of ``SamplingParams.n``); with n > 1 each choice
    ends with its own ``final`` and the turn with the n-th."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """With ``sampling.logprobs``: one entry per token id (the worker filled in their texts)."""


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

    async def start(self, start: TurnStart) -> None:
        """Start a turn (the next one, on a chat's stream)."""

    async def cancel_turn(self) -> None:
        """Ask the worker to end the turn in progress (it answers with a CANCELLED final frame)."""

    async def read(self) -> Frame:
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


async def read_or_cancel(stream: WorkerStream, cancel: asyncio.Event) -> tuple[Frame, bool]:
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
) -> tuple[Frame, bool]:
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
