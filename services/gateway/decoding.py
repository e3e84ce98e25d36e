"""Undecodable requests become INVALID_ARGUMENT instead of grpc's UNKNOWN with parser text.

protobuf refuses a ``string`` field holding bad UTF-8 while grpc deserializes the request, before any
handler runs; grpc then answers UNKNOWN with the parser's message. :func:`register_guarded` wraps
every method's deserializer so such a message becomes a marker, and the handler turns the marker
into :class:`InvalidArgument`, which the one error mapper reports like any other bad input.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import InvalidArgument

_MESSAGE = "the request could not be decoded (text fields must be valid UTF-8); fix the encoding of the request"


class _Malformed:
    """Stands in for a request that failed to decode."""


MALFORMED = _Malformed()


def _guard_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def guarded(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError:
            return MALFORMED

    return guarded


async def _rejected() -> AsyncIterator[Any]:
    raise InvalidArgument(_MESSAGE)
    yield  # pragma: no cover - makes this an async generator


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if request is MALFORMED:
            raise InvalidArgument(_MESSAGE)
        yield request


def guard_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with a deserializer that never raises and a behaviour that rejects the marker."""
    deserializer = _guard_deserializer(handler.request_deserializer)
    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is MALFORMED:
                raise InvalidArgument(_MESSAGE)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # The handler's own generator, not one re-yielding it: no extra hop per streamed frame.
            if request is MALFORMED:
                return _rejected()
            return inner_us(request, context)  # type: ignore[no-any-return]

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)
    if handler.stream_stream is not None:
        inner_ss = handler.stream_stream

        def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            return inner_ss(_checked_stream(requests), context)  # type: ignore[no-any-return]

        return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, serializer)
    return handler


class GuardedServer:
    """Looks like a ``grpc.aio.Server`` to generated ``add_*Servicer_to_server`` functions."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(service, {k: guard_handler(v) for k, v in handlers.items()})


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(handler_call_details)
        return guard_handler(handler) if handler is not None else None
