"""Router side of the stream transport (services/common/muxwire.py): a GenerateMux call over TCP.

:class:`StreamMuxCall` has the surface of the ``grpc.aio.StreamStreamCall`` that
:class:`~services.router.mux.MuxChannel` drives (``write``, iterate, ``cancel``), and fails as that
call would: every error is a ``grpc.aio.AioRpcError`` with UNAVAILABLE (the worker is gone or
unreachable), so the router's retry and resume treat both transports alike. :attr:`refused` is
set when the worker cannot be spoken to this way at all (nothing listens, or it refused the
credential): the channel then goes back to gRPC's GenerateMux for that worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from services.common.muxwire import HELLO_TIMEOUT_S, MAGIC, FrameProtocol, WireError
from services.common.pb.meshserve.internal.v1 import worker_pb2


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def split_host(address: str) -> str:
    """The host of a ``host:port`` address (IPv6 brackets kept off)."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class StreamMuxCall:
    """One connection to a worker's stream port, used like a GenerateMux call (see module doc)."""

    def __init__(self, host: str, port: int, internal_token: str, max_frame: int) -> None:
        self.address = (host, port)
        self._where = f"{host}:{port}"
        self.refused = False
        self._protocol: FrameProtocol | None = None
        self._cancelled = False
        self._ready = asyncio.ensure_future(self._open(host, port, internal_token.encode(), max_frame))

    async def _open(self, host: str, port: int, token: bytes, max_frame: int) -> FrameProtocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                _, protocol = await loop.create_connection(lambda: FrameProtocol(max_frame), host, port)
                protocol.write(MAGIC + token)
                answer = await protocol.read()
        except (OSError, TimeoutError) as exc:
            self.refused = True
            raise _unavailable(f"cannot reach the worker's stream port {self._where}: {exc}") from None
        if answer is None or answer:
            self.refused = True
            protocol.close()
            reason = answer.decode(errors="replace") if answer else "it closed the connection"
            raise _unavailable(f"the worker's stream port {self._where} refused the router: {reason}")
        self._protocol = protocol
        if self._cancelled:
            protocol.close()
        return protocol

    async def _connection(self) -> FrameProtocol:
        return self._protocol if self._protocol is not None else await self._ready

    async def write(self, message: worker_pb2.MuxRequest) -> None:
        protocol = await self._connection()
        try:
            protocol.write(message.SerializeToString())
            await protocol.drain()
        except ConnectionError:
            raise _unavailable(f"the connection to the worker's stream port {self._where} ended") from None

    def __aiter__(self) -> AsyncIterator[worker_pb2.MuxResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[worker_pb2.MuxResponse]:
        protocol = await self._connection()
        while (payload := await protocol.read()) is not None:
            try:
                yield worker_pb2.MuxResponse.FromString(payload)
            except DecodeError:
                protocol.fail(WireError("a frame that is not a MuxResponse"))
        if self._cancelled:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="cancelled"
            )
        if protocol.error is not None:
            raise _unavailable(f"the connection to the worker's stream port {self._where} broke: {protocol.error}")
        # A clean end: the worker ended the call (it drains); MuxChannel fails what is left with UNAVAILABLE.

    def cancel(self) -> bool:
        if self._cancelled:
            return False
        self._cancelled = True
        if self._protocol is not None:
            self._protocol.close()
        elif not self._ready.done():
            self._ready.cancel()
        return True
