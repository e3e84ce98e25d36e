"""Every branch of the router-status -> domain-error mapper."""

from __future__ import annotations

import grpc
import pytest

from services.common import errors
from services.gateway.errors import from_router_error


def rpc_error(code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=details)


@pytest.mark.parametrize(
    ("code", "kind", "keeps_text"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument, True),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded, False),
        (grpc.StatusCode.CANCELLED, errors.Cancelled, False),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable, False),
        (grpc.StatusCode.INTERNAL, errors.MeshError, False),
        (grpc.StatusCode.PERMISSION_DENIED, errors.MeshError, False),
        (grpc.StatusCode.UNKNOWN, errors.MeshError, False),
    ],
)
def test_mapping(code: grpc.StatusCode, kind: type[errors.MeshError], keeps_text: bool) -> None:
    mapped = from_router_error(rpc_error(code, "router says\nsomething internal"))
    assert type(mapped) is kind
    assert ("router says something internal" in mapped.message) is keeps_text
    assert "\n" not in mapped.message and mapped.message


def test_retry_after_trailer_is_kept_and_defaults() -> None:
    mapped = from_router_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after-ms", "250"),)))
    assert isinstance(mapped, errors.ResourceExhausted) and mapped.retry_after_ms == 250
    mapped = from_router_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after-ms", "x"),)))
    assert isinstance(mapped, errors.ResourceExhausted) and mapped.retry_after_ms == 1000
