"""Turn a status the router returned into the domain error the caller sees.

User-facing statuses (bad input, unknown model, rate limit) keep the router's one-line message, which
is written for callers; every other status gets a fixed message, so internal text never leaks.
"""

from __future__ import annotations

import grpc
import structlog

from services.common import metadata as md
from services.common.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

log = structlog.get_logger(__name__)

_MAX_DETAIL_CHARS = 300
_INTERNAL = "internal error in the inference mesh; retry, and report the x-request-id if it persists"


def _one_line(text: str | None, fallback: str) -> str:
    line = " ".join((text or "").split())
    return line[:_MAX_DETAIL_CHARS] if line else fallback


def from_router_error(exc: grpc.aio.AioRpcError) -> MeshError:
    """The domain error for a failed router call (logged when it is not the caller's fault)."""
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(_one_line(exc.details(), "the request is invalid"))
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(_one_line(exc.details(), "the requested model does not exist; see ListModels"))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(
            _one_line(exc.details(), "the mesh is at capacity; retry after the retry-after-ms delay"),
            retry_after_ms=md.retry_after_ms(exc.trailing_metadata()),
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(
            "the request did not finish before its deadline; allow more time or ask for fewer tokens"
        )
    if code == grpc.StatusCode.CANCELLED:
        return Cancelled("the request was cancelled")
    log.warning("router_call_failed", code=code.name, details=exc.details())
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable("no inference backend is available right now; retry in a few seconds")
    return MeshError(_INTERNAL)
