"""A worker's failure status becomes the router's domain error (worker text never passed on), and a
RESOURCE_EXHAUSTED keeps the worker's retry delay."""

from __future__ import annotations

import grpc
import pytest

from services.common import errors
from services.common import metadata as md
from services.router.worker_stream import domain_error


def _status(code: grpc.StatusCode, *trailers: tuple[str, str]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details="secret detail at 10.0.0.7"
    )


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, errors.Cancelled),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.INTERNAL, errors.Unavailable),
        (grpc.StatusCode.UNKNOWN, errors.Unavailable),
    ],
)
def test_each_status_maps_to_its_domain_error_without_the_worker_text(
    code: grpc.StatusCode, kind: type[errors.MeshError]
) -> None:
    error = domain_error(_status(code))
    assert type(error) is kind
    assert "secret" not in error.message and "\n" not in error.message


def test_resource_exhausted_keeps_the_worker_retry_delay() -> None:
    error = domain_error(_status(grpc.StatusCode.RESOURCE_EXHAUSTED, (md.RETRY_AFTER_MS, "250")))
    assert isinstance(error, errors.ResourceExhausted) and error.retry_after_ms == 250
    default = domain_error(_status(grpc.StatusCode.RESOURCE_EXHAUSTED))
    assert isinstance(default, errors.ResourceExhausted) and default.retry_after_ms == md.DEFAULT_RETRY_AFTER_MS


@pytest.mark.parametrize(
    ("trailers", "expected"),
    [
        ((), md.DEFAULT_RETRY_AFTER_MS),
        (None, md.DEFAULT_RETRY_AFTER_MS),
        (((md.RETRY_AFTER_MS, "1234"),), 1234),
        (((md.RETRY_AFTER_MS, b"77"),), 77),
        ((("x-request-id", "abc"), (md.RETRY_AFTER_MS, "0")), 0),
        (((md.RETRY_AFTER_MS, "soon"),), md.DEFAULT_RETRY_AFTER_MS),
        (((md.RETRY_AFTER_MS, "-5"),), md.DEFAULT_RETRY_AFTER_MS),
    ],
)
def test_retry_after_ms_reads_the_trailer(trailers: object, expected: int) -> None:
    assert md.retry_after_ms(trailers) == expected  # type: ignore[arg-type]
