"""The one mapper from a status an upstream service answered with to the domain error our caller sees.

The reverse of :func:`services.common.interceptors.status_for`, used wherever a mesh service hears a
status from the next hop: the gateway from a router in its own process (a gRPC call's status), the
router from a worker (the status a stream of the stream transport ended with). What the status means
to our caller depends on who said it (:class:`Upstream`):

- a **router** writes its messages for callers: bad input, an unknown model and a rate limit keep its
  one-line message; any status not listed below is an internal error of the mesh (logged);
- a **worker**'s text never reaches a caller (it may name hosts or internals), and a status not listed
  below means the worker failed: UNAVAILABLE, which the router retries or resumes elsewhere.

Every other mapped status gets a fixed message that says what happened and what to do.
"""

from __future__ import annotations

import enum

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
WORKER_FAILED = "the worker serving this request failed; retry the request"
"""What a caller is told when its worker failed and no other could take over."""
_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class Upstream(enum.Enum):
    """Who answered with the status (see the module docstring)."""

    ROUTER = "router"
    WORKER = "worker"


def status_code(number: int) -> grpc.StatusCode:
    """The status code of its number on the wire (UNKNOWN for a number gRPC does not define)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def _one_line(text: str | None, fallback: str) -> str:
    line = " ".join((text or "").split())
    return line[:_MAX_DETAIL_CHARS] if line else fallback


def from_status(
    code: grpc.StatusCode,
    details: str | None,
    upstream: Upstream,
    retry_after_ms: int = md.DEFAULT_RETRY_AFTER_MS,
    *,
    retry_sent: bool = False,
) -> MeshError:
    """The domain error for ``upstream``'s status ``code`` with its message ``details`` and, for
    RESOURCE_EXHAUSTED, its retry delay (see the module docstring). ``retry_sent``: the status carried a
    ``retry-after-ms`` trailer; a router's UNAVAILABLE with one (a model waking up, or whose wake failed)
    keeps its message, which names the model, and its delay."""
    caller_text = upstream is Upstream.ROUTER
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        fixed = "the request's parameters were rejected; check them against ListModels"
        return InvalidArgument(_one_line(details, fixed) if caller_text else fixed)
    if code == grpc.StatusCode.NOT_FOUND:
        fixed = "the requested model does not exist; see ListModels"
        return NotFound(_one_line(details, fixed) if caller_text else fixed)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        fixed = "the mesh is at capacity; retry after the retry-after-ms delay"
        return ResourceExhausted(_one_line(details, fixed) if caller_text else fixed, retry_after_ms)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(
            "the request did not finish before its deadline; allow more time or ask for fewer tokens"
        )
    if code == grpc.StatusCode.CANCELLED:
        return Cancelled("the request was cancelled")
    if upstream is Upstream.WORKER:  # the router logs the worker's failure where it decides what to do
        return Unavailable(WORKER_FAILED)
    if code == grpc.StatusCode.UNAVAILABLE and retry_sent and retry_after_ms > 0:
        return Unavailable(_one_line(details, "the model is not available yet; retry later"), retry_after_ms)
    log.warning("router_call_failed", code=code.name, details=details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable("no inference backend is available right now; retry in a few seconds")
    return MeshError(_INTERNAL)


def from_rpc_error(exc: grpc.aio.AioRpcError, upstream: Upstream) -> MeshError:
    """:func:`from_status` of a failed gRPC call (its retry delay read from the ``retry-after-ms`` trailer)."""
    sent = md.sent_retry_after_ms(exc.trailing_metadata())
    retry = md.DEFAULT_RETRY_AFTER_MS if sent is None else sent
    return from_status(exc.code(), exc.details(), upstream, retry, retry_sent=sent is not None)


def retry_trailer(exc: MeshError) -> tuple[str, str] | None:
    """The ``retry-after-ms`` trailer a server sends with ``exc``: always for RESOURCE_EXHAUSTED, for
    UNAVAILABLE when it advises a delay (a model waking up); None otherwise."""
    if isinstance(exc, ResourceExhausted) or (isinstance(exc, Unavailable) and exc.retry_after_ms > 0):
        return (md.RETRY_AFTER_MS, str(exc.retry_after_ms))
    return None
