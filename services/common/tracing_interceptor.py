"""Server side of tracing: every RPC runs inside a SERVER span whose parent comes from its metadata.

Installed by :func:`services.common.serving.start_server` only when tracing is on, innermost (after
the error mapper), so the span covers the handler and sees domain errors before they become status
codes. Health checks, reflection, load reports and heartbeats are not traced. On a public server
(the gateway: no internal credential) a caller's sampling flag is not followed
(:func:`services.common.tracing.start_server_span` with ``public``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.common import tracing
from services.common.errors import MeshError
from services.common.interceptors import rewrap_handler

# Probes and load reports arrive every second per replica: traced, they would bury the requests.
_EXEMPT_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.",
    "/meshserve.internal.v1.Worker/Stats",
    "/meshserve.internal.v1.WorkerRegistry/",
)


def _code(exc: BaseException) -> str:
    if isinstance(exc, MeshError):
        return exc.code
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    if isinstance(exc, grpc.aio.AbortError):
        return "ABORTED_BY_HANDLER"
    return "INTERNAL"


def _traced(handler: grpc.RpcMethodHandler, method: str, public: bool) -> grpc.RpcMethodHandler:
    def begin(context: grpc.aio.ServicerContext) -> Any:
        return tracing.start_server_span(method, context.invocation_metadata() or (), public=public)

    def unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = begin(context)
            try:
                return await fn(request, context)
            except BaseException as exc:
                tracing.record_error(span, exc, _code(exc))
                raise
            finally:
                span.end()

        return call

    def streaming(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            span = begin(context)
            try:
                async for item in fn(request, context):
                    yield item
            except BaseException as exc:
                tracing.record_error(span, exc, _code(exc))
                raise
            finally:
                span.end()

        return call

    return rewrap_handler(handler, unary, streaming)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every traced method's handler in a SERVER span named after the method.

    ``public``: callers are outside the mesh, so the sampling decision is ours, not theirs.
    """

    def __init__(self, *, public: bool = False) -> None:
        self._public = public

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_EXEMPT_PREFIXES):
            return handler
        return _traced(handler, details.method.lstrip("/"), self._public)
