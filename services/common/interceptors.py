"""gRPC server interceptors: request context, internal credential check, and the one error mapper.

``ContextInterceptor`` binds ``request_id``/``tenant`` from metadata into structlog contextvars.
``ErrorInterceptor`` turns :mod:`services.common.errors` into status codes; anything else becomes
INTERNAL with a generic message (the traceback is logged, never sent).
``InternalAuthInterceptor`` refuses calls that lack the internal credential (workers, router).
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from services.common import metadata as md
from services.common import tracing
from services.common.errors import MeshError
from services.common.status_errors import retry_trailer

log = structlog.get_logger(__name__)

_STATUS = {name: getattr(grpc.StatusCode, name) for name in grpc.StatusCode.__members__}
_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def status_for(exc: MeshError) -> grpc.StatusCode:
    """The gRPC status code of a domain error."""
    return _STATUS.get(exc.code, grpc.StatusCode.INTERNAL)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the status that ``exc`` maps to. Always raises."""
    if isinstance(exc, MeshError):
        if (trailer := retry_trailer(exc)) is not None:
            # Added to what the handler set (the gateway's x-request-id), not in place of it.
            earlier = tuple(context.trailing_metadata() or ())
            context.set_trailing_metadata((*earlier, trailer))
        await context.abort(status_for(exc), exc.message)
    log.error("internal_error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error; the server log has the details")


def _is_passthrough(exc: BaseException) -> bool:
    return isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit))


def _wrap_handler(
    handler: grpc.RpcMethodHandler, around: Callable[[Any, grpc.aio.ServicerContext], None]
) -> grpc.RpcMethodHandler:
    """Wrap every kind of behaviour so errors are mapped and ``around`` runs first."""

    def unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            around(request, context)
            try:
                return await fn(request, context)
            except BaseException as exc:
                if _is_passthrough(exc):
                    raise
                await abort_with(context, exc)

        return call

    def streaming(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            around(request, context)
            try:
                async for item in fn(request, context):
                    yield item
            except BaseException as exc:
                if _is_passthrough(exc):
                    raise
                await abort_with(context, exc)

        return call

    return rewrap_handler(handler, unary, streaming)


Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
_FACTORIES = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
)


def rewrap_handler(handler: grpc.RpcMethodHandler, unary: Wrap, streaming: Wrap) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped: by ``unary`` when it returns one response (whatever the
    requests), by ``streaming`` when it yields responses; serializers kept."""
    for attr, factory, streams in _FACTORIES:
        fn = getattr(handler, attr)
        if fn is not None:
            return factory(  # type: ignore[operator]
                (streaming if streams else unary)(fn),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Binds request context and maps domain errors to gRPC status for every method."""

    def __init__(self) -> None:
        # method -> (the handler it had, that handler wrapped): a call reuses the wrapping instead
        # of building handler objects and closures per call. Replaced, never grown, when a method's
        # handler changes (a traced handler is new on every call).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_EXEMPT_PREFIXES):
            return handler
        method = details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]

        def bind(_request: Any, context: grpc.aio.ServicerContext) -> None:
            meta = _metadata(context)
            structlog.contextvars.bind_contextvars(
                request_id=meta.get(md.REQUEST_ID) or uuid.uuid4().hex,
                tenant=meta.get(md.TENANT, ""),
                rpc=method,
            )

        wrapped = _wrap_handler(handler, bind)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


class InternalAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the internal credential (constant-time compare). Health is exempt."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_EXEMPT_PREFIXES):
            return await continuation(details)
        given = ""
        for key, value in details.invocation_metadata or ():
            if key == md.INTERNAL_TOKEN and isinstance(value, str):
                given = value
        if hmac.compare_digest(given.encode(), self._token):
            return await continuation(details)
        return _deny(await continuation(details))


def _deny(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """A handler of the same shape that rejects with PERMISSION_DENIED."""
    if handler is None:
        return None
    message = "this internal service only accepts calls from inside the mesh (missing or wrong internal credential)"

    async def unary(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

    async def streaming(_request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_unary or handler.stream_unary:
        factory = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return factory(unary, handler.request_deserializer, handler.response_serializer)
    factory = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return factory(streaming, handler.request_deserializer, handler.response_serializer)


def outbound_metadata(internal_token: str, **extra: str) -> tuple[tuple[str, str], ...]:
    """Metadata for a call to another mesh service: request id and tenant from context + token."""
    ctx = structlog.contextvars.get_contextvars()
    pairs = {
        md.REQUEST_ID: str(ctx.get("request_id", "")),
        md.TENANT: str(ctx.get("tenant", "")),
        md.INTERNAL_TOKEN: internal_token,
        **extra,
    }
    tracing.inject(pairs)  # W3C traceparent of the current span (nothing when tracing is off)
    return tuple((k, v) for k, v in pairs.items() if v)
