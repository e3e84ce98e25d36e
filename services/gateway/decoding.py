"""Undecodable requests become INVALID_ARGUMENT instead of grpc's UNKNOWN with parser text.

protobuf refuses a ``string`` field holding bad UTF-8 while grpc deserializes the request, before any
handler runs; grpc then answers UNKNOWN with the parser's message. :func:`register_guarded` wraps
every method's deserializer so such a message becomes a marker, and the handler turns the marker
into :class:`InvalidArgument`, which the one error mapper reports like any other bad input.

protobuf's error does not say which field was bad, so :func:`bad_utf8_field` walks the wire bytes
(only after a failed parse, so the cost is on bad requests alone) to name it: ``turn.messages[1].content``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from services.common.errors import InvalidArgument

_MESSAGE = "the request could not be decoded (text fields must be valid UTF-8); fix the encoding of the request"


class _Malformed:
    """Stands in for a request that failed to decode; ``message`` says why, naming the field if known."""

    def __init__(self, message: str = _MESSAGE) -> None:
        self.message = message


MALFORMED = _Malformed()


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]  # IndexError past the end: the caller gives up
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise ValueError("varint too long")


def bad_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path of the first ``string`` field in the encoded ``data`` that is not valid UTF-8 (repeated
    fields with their index, ``turn.messages[0].content``), or None if none is found or the bytes are
    not a readable encoding at all."""
    seen: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if field.is_repeated:
                    index = seen.get(number, 0)
                    seen[number] = index + 1
                    name = f"{name}[{index}]"
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
                    found = bad_utf8_field(field.message_type, chunk, name + ".")
                    if found is not None:
                        return found
            else:
                return None  # groups or junk: no field to name
    except (IndexError, ValueError):
        return None
    return None


def _guard_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)

    def guarded(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError:
            field = bad_utf8_field(descriptor, data) if isinstance(descriptor, Descriptor) else None
            if field is None:
                return MALFORMED
            return _Malformed(f"the field {field!r} is not valid UTF-8; send text fields as UTF-8")

    return guarded


async def _rejected(message: str) -> AsyncIterator[Any]:
    raise InvalidArgument(message)
    yield  # pragma: no cover - makes this an async generator


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            raise InvalidArgument(request.message)
        yield request


def guard_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with a deserializer that never raises and a behaviour that rejects the marker."""
    deserializer = _guard_deserializer(handler.request_deserializer)
    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                raise InvalidArgument(request.message)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # The handler's own generator, not one re-yielding it: no extra hop per streamed frame.
            if isinstance(request, _Malformed):
                return _rejected(request.message)
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
