"""Router side of the stream transport (services/common/muxwire.py): a GenerateMux call over TCP.

:class:`StreamMuxCall` has the surface of the ``grpc.aio.StreamStreamCall`` that
:class:`~services.router.mux.MuxChannel` drives (``write``, iterate, ``cancel``), and fails as that
call would: every error is a ``grpc.aio.AioRpcError`` with UNAVAILABLE (the worker is gone or its
connection broke), so the router's retry and resume treat both transports alike. When the worker
cannot be spoken to this way at all (nothing listens on the port, or it refuses the credential),
the call goes on as the gRPC GenerateMux call ``fallback()`` opens, and ``on_refused`` is told,
so that the channel's next calls to that worker use gRPC from the start.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from services.common.muxwire import HELLO_TIMEOUT_S, MAGIC, FrameProtocol, messages
from services.common.pb.meshserve.internal.v1 import worker_pb2

log = structlog.get_logger(__name__)
Address = tuple[str, int]


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _cancelled() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="cancelled"
    )


def split_host(address: str) -> str:
    """The host of a ``host:port`` address (IPv6 brackets kept off)."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class StreamMuxCall:
    """One connection to a worker's stream port, used like a GenerateMux call (see module doc)."""

    def __init__(
        self,
        address: Address,
        internal_token: str,
        max_frame: int,
        fallback: Callable[[], grpc.aio.StreamStreamCall],
        on_refused: Callable[[Address], None],
    ) -> None:
        self.address = address
        self._where = f"{address[0]}:{address[1]}"
        self._fallback = fallback
        self._on_refused = on_refused
        self._protocol: FrameProtocol | None = None
        self._grpc: grpc.aio.StreamStreamCall | None = None
        self._cancelled = False
        self._ready = asyncio.ensure_future(self._open(internal_token.encode(), max_frame))

    async def _open(self, token: bytes, max_frame: int) -> FrameProtocol | None:
        loop = asyncio.get_running_loop()
        protocol: FrameProtocol | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                _, protocol = await loop.create_connection(lambda: FrameProtocol(max_frame), *self.address)
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
        log.warning("worker_stream_transport_unusable", address=self._where, reason=reason, fallback="grpc")
        self._on_refused(self.address)
        if not self._cancelled:
            self._grpc = self._fallback()
        return None

    async def _connection(self) -> FrameProtocol | None:
        return self._protocol if self._protocol is not None else await self._ready

    async def write(self, message: worker_pb2.MuxRequest) -> None:
        protocol = await self._connection()
        if protocol is None:
            if self._grpc is None:
                raise grpc.aio.UsageError("the call was cancelled")
            await self._grpc.write(message)
            return
        try:
            protocol.write(message.SerializeToString())
            await protocol.drain()
        except ConnectionError:
            raise _unavailable(f"the connection to the worker's stream port {self._where} ended") from None

    def __aiter__(self) -> AsyncIterator[worker_pb2.MuxResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[worker_pb2.MuxResponse]:
        protocol = await self._connection()
        if protocol is None:
            if self._grpc is not None:
                async for message in self._grpc:
                    yield message
                return
            raise _cancelled()
        async for message in messages(protocol, worker_pb2.MuxResponse):
            yield message
        if self._cancelled:
            raise _cancelled()
        if protocol.error is not None:
            raise _unavailable(f"the connection to the worker's stream port {self._where} broke: {protocol.error}")
        # A clean end: the worker ended the call (it drains); MuxChannel fails what is left with UNAVAILABLE.

    def cancel(self) -> bool:
        if self._cancelled:
            return False
        self._cancelled = True
        if self._protocol is not None:
            self._protocol.close()
        if self._grpc is not None:
            self._grpc.cancel()
        return True
