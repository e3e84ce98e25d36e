"""Prometheus metrics of the OpenAI HTTP adapter: requests by endpoint and HTTP status, and their
duration (a stream's until its last event is written)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import Counter, Histogram

CLIENT_CLOSED = 499
"""The code counted for a request whose client went away before its answer ended."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

HTTP_REQUESTS = Counter(
    "meshserve_http_requests_total",
    "HTTP requests the OpenAI adapter answered, by endpoint and HTTP status code.",
    ["endpoint", "code"],
)
HTTP_DURATION = Histogram(
    "meshserve_http_request_duration_seconds",
    "Time from an HTTP request's arrival at the adapter to its last byte (streams included).",
    ["endpoint"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)


def endpoint(request: web.Request) -> str:
    """The route's pattern (``/v1/models/{model}``), ``other`` for paths no route serves: bounded labels."""
    info = request.match_info.route.resource
    return info.canonical if info is not None else "other"


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Counts every answer, errors included (installed outside the error mapper, so it sees its replies)."""
    start = time.perf_counter()
    code = 500
    try:
        response = await handler(request)
        code = response.status
        return response
    except web.HTTPException as exc:  # a redirect or the like that the error mapper passed on
        code = exc.status
        raise
    except asyncio.CancelledError:  # the client hung up: nginx's 499, whatever was sent before
        code = CLIENT_CLOSED
        raise
    finally:
        name = endpoint(request)
        HTTP_REQUESTS.labels(name, str(code)).inc()
        HTTP_DURATION.labels(name).observe(time.perf_counter() - start)
