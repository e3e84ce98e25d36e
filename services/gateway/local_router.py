"""The router embedded in the gateway's process: the router servicer called in place, no network hop.

With ``embed_router`` the gateway process also runs the router (its own internal gRPC server, where
workers register and heartbeat, ``meshserve status`` reads replicas, and other gateways may call it),
and the gateway calls that router's Inference servicer directly through :class:`LocalRouter`, which
has the surface of ``InferenceStub`` that :class:`~services.gateway.servicer.GatewayServicer` uses:
``Generate`` (iterate, ``cancel``), ``Complete`` and ``ListModels`` (await), ``Chat`` (``write``,
``done_writing``, iterate, ``cancel``). One gRPC hop, its serialization, its interceptors and a
second coalescing reader go away (the gateway merges frames; the router's ``generate_frames``
runs without its own merging here). docs/benchmarks/hops.md measures both layouts.

What the network hop carried travels in the task's context instead: the request id, tenant and key
id are the gateway's structlog contextvars (the router reads them there), the trace is the current
span. The deadline becomes the router's ``time_remaining``, which the router gives its worker calls.
Errors are the router's domain errors (:class:`~services.common.errors.MeshError`), raised as they
are: they are already written for callers. Cancelling the caller's call closes the router's
generator, which cancels the worker call, as a cancelled gRPC call did.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Generator
from typing import Any, Generic, TypeVar

from services.common.errors import Unavailable
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc

T = TypeVar("T")
_DONE = object()
_CHAT_BUFFER = 16
"""Chat frames written and not yet read by the router: a write beyond waits (as gRPC flow control
makes a remote call's write wait), so a client pipelining frames cannot grow the gateway's memory."""
_closing: set[asyncio.Task[None]] = set()


class _Context:
    """The part of a grpc ServicerContext the router's servicer reads: the time left."""

    def __init__(self, timeout: float | None) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


class _StreamCall(Generic[T]):
    """A server-streaming call in place: iterate it once; ``cancel`` closes the router's generator."""

    def __init__(self, frames: AsyncGenerator[T, None]) -> None:
        self._frames = frames

    def __aiter__(self) -> AsyncGenerator[T, None]:
        return self._frames

    async def aclose(self) -> None:
        await self._frames.aclose()

    def cancel(self) -> bool:
        # A generator that is running is being closed by whoever iterates it (coalesced() closes its
        # source, a cancelled reader task unwinds it); one that has ended needs nothing; one not
        # running (never started, or suspended between frames) is closed here.
        if getattr(self._frames, "ag_running", False) or getattr(self._frames, "ag_frame", None) is None:
            return False
        task = asyncio.get_running_loop().create_task(self._frames.aclose())
        _closing.add(task)  # a task nobody references may be collected before it has run
        task.add_done_callback(_closing.discard)
        return True


class _UnaryCall(Generic[T]):
    """A unary call in place: await it (once)."""

    def __init__(self, reply: Coroutine[Any, Any, T]) -> None:
        self._reply = reply

    def __await__(self) -> Generator[Any, None, T]:
        return self._reply.__await__()

    def cancel(self) -> bool:
        with contextlib.suppress(RuntimeError):  # no-op once awaited to the end
            self._reply.close()  # a never-awaited one is then not warned about
        return True


class _ChatCall:
    """A bidi Chat call in place: ``write`` / ``done_writing`` feed the router's request iterator."""

    def __init__(self, router: inference_pb2_grpc.InferenceServicer, timeout: float | None) -> None:
        self._inbox: asyncio.Queue[object] = asyncio.Queue(maxsize=_CHAT_BUFFER)
        self._frames: AsyncGenerator[pb.ChatResponse, None] = router.Chat(self._requests(), _Context(timeout))  # type: ignore[arg-type,assignment]
        self._stream = _StreamCall(self._frames)

    async def _requests(self) -> AsyncIterator[pb.ChatRequest]:
        while (msg := await self._inbox.get()) is not _DONE:
            assert isinstance(msg, pb.ChatRequest)
            yield msg

    async def write(self, request: pb.ChatRequest) -> None:
        await self._inbox.put(request)  # waits while the router has not read what came before

    async def done_writing(self) -> None:
        await self._inbox.put(_DONE)

    def __aiter__(self) -> AsyncGenerator[pb.ChatResponse, None]:
        return self._frames

    def cancel(self) -> bool:
        with contextlib.suppress(asyncio.QueueFull):  # full: the router is not reading; closing it ends it
            self._inbox.put_nowait(_DONE)
        return self._stream.cancel()


class LocalRouter:
    """``InferenceStub``'s surface over an in-process router servicer (see the module docstring).

    ``servicer`` may be set after construction (the gateway's server starts first, so the process's
    tracing and its announced port are the gateway's); until then calls fail with UNAVAILABLE.
    """

    def __init__(self, servicer: inference_pb2_grpc.InferenceServicer | None = None) -> None:
        self.servicer = servicer

    def _router(self) -> inference_pb2_grpc.InferenceServicer:
        if self.servicer is None:
            raise Unavailable("the gateway's router is still starting; retry in a moment")
        return self.servicer

    def Generate(
        self, request: pb.GenerateRequest, metadata: object = None, timeout: float | None = None
    ) -> _StreamCall[pb.GenerateResponse]:
        router = self._router()
        frames = getattr(router, "generate_frames", None)  # the real router: no second coalescing reader
        if frames is not None:
            return _StreamCall(frames(request, _Context(timeout), coalesce=False))
        return _StreamCall(router.Generate(request, _Context(timeout)))  # type: ignore[arg-type]

    def Complete(
        self, request: pb.GenerateRequest, metadata: object = None, timeout: float | None = None
    ) -> _UnaryCall[pb.GenerateResponse]:
        return _UnaryCall(self._router().Complete(request, _Context(timeout)))  # type: ignore[arg-type]

    def ListModels(
        self, request: pb.ListModelsRequest, metadata: object = None, timeout: float | None = None
    ) -> _UnaryCall[pb.ListModelsResponse]:
        return _UnaryCall(self._router().ListModels(request, _Context(timeout)))  # type: ignore[arg-type]

    def Chat(self, metadata: object = None, timeout: float | None = None) -> _ChatCall:
        return _ChatCall(self._router(), timeout)
