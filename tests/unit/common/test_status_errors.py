"""Every branch of the one status -> domain-error mapper (services/common/status_errors.py): a
router's status keeps its caller-facing text, a worker's never does, and RESOURCE_EXHAUSTED keeps
the upstream's retry delay."""

from __future__ import annotations

import grpc
import pytest

from services.common import errors
from services.common import metadata as md
from services.common.status_errors import Upstream, from_rpc_error, from_status, status_code

ROUTER, WORKER = Upstream.ROUTER, Upstream.WORKER


def rpc_error(
    code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str | bytes], ...] = ()
) -> grpc.aio.AioRpcError:
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
def test_a_routers_status(code: grpc.StatusCode, kind: type[errors.MeshError], keeps_text: bool) -> None:
    mapped = from_rpc_error(rpc_error(code, "router says\nsomething internal"), ROUTER)
    assert type(mapped) is kind
    assert ("router says something internal" in mapped.message) is keeps_text
    assert "\n" not in mapped.message and mapped.message


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED]
)
def test_a_routers_caller_facing_status_without_text_gets_a_fixed_message(code: grpc.StatusCode) -> None:
    mapped = from_status(code, "  \n ", ROUTER)
    assert mapped.message.strip() and mapped.code == code.name


def test_a_routers_long_text_is_cut_to_one_bounded_line() -> None:
    mapped = from_status(grpc.StatusCode.INVALID_ARGUMENT, "x" * 1000, ROUTER)
    assert mapped.message == "x" * 300


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, errors.Cancelled),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.INTERNAL, errors.Unavailable),
        (grpc.StatusCode.UNKNOWN, errors.Unavailable),
        (grpc.StatusCode.PERMISSION_DENIED, errors.Unavailable),
    ],
)
def test_a_workers_status_never_passes_its_text_on(code: grpc.StatusCode, kind: type[errors.MeshError]) -> None:
    error = from_status(code, "secret detail at 10.0.0.7", WORKER)
    assert type(error) is kind
    assert "secret" not in error.message and "\n" not in error.message and error.message


@pytest.mark.parametrize("upstream", [ROUTER, WORKER])
def test_resource_exhausted_keeps_the_upstreams_retry_delay(upstream: Upstream) -> None:
    error = from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", upstream, 250)
    assert isinstance(error, errors.ResourceExhausted) and error.retry_after_ms == 250
    default = from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", upstream)
    assert isinstance(default, errors.ResourceExhausted) and default.retry_after_ms == md.DEFAULT_RETRY_AFTER_MS


def test_a_calls_retry_delay_is_read_from_its_trailer() -> None:
    mapped = from_rpc_error(
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", ((md.RETRY_AFTER_MS, "250"),)), ROUTER
    )
    assert isinstance(mapped, errors.ResourceExhausted) and mapped.retry_after_ms == 250
    mapped = from_rpc_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", ((md.RETRY_AFTER_MS, "x"),)), ROUTER)
    assert isinstance(mapped, errors.ResourceExhausted) and mapped.retry_after_ms == md.DEFAULT_RETRY_AFTER_MS


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


def test_status_numbers_on_the_wire() -> None:
    assert status_code(14) is grpc.StatusCode.UNAVAILABLE
    assert status_code(0) is grpc.StatusCode.OK
    assert status_code(999) is grpc.StatusCode.UNKNOWN


def test_a_routers_unavailable_with_a_retry_trailer_keeps_its_message_and_delay() -> None:
    waking = "model 'a' is waking up and did not become ready within 60 s; retry after 5 s"
    mapped = from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE, waking, ((md.RETRY_AFTER_MS, "5000"),)), ROUTER)
    assert isinstance(mapped, errors.Unavailable) and mapped.retry_after_ms == 5000 and mapped.message == waking
    plain = from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to 10.0.0.7", ()), ROUTER)
    assert isinstance(plain, errors.Unavailable) and plain.retry_after_ms == 0 and "10.0.0.7" not in plain.message
    worker = from_rpc_error(rpc_error(grpc.StatusCode.UNAVAILABLE, "secret", ((md.RETRY_AFTER_MS, "5000"),)), WORKER)
    assert isinstance(worker, errors.Unavailable) and "secret" not in worker.message


def test_the_retry_trailer_of_each_error() -> None:
    from services.common.status_errors import retry_trailer

    assert retry_trailer(errors.ResourceExhausted("full", 250)) == (md.RETRY_AFTER_MS, "250")
    assert retry_trailer(errors.Unavailable("waking", 5000)) == (md.RETRY_AFTER_MS, "5000")
    assert retry_trailer(errors.Unavailable("no backend")) is None
    assert retry_trailer(errors.InvalidArgument("bad")) is None
