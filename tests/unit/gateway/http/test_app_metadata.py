"""Which caller headers the HTTP adapter forwards to the gateway as gRPC metadata, and which it refuses."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from services.common.errors import InvalidArgument
from services.gateway.http.app import MAX_CREDENTIAL_CHARS, OpenAIApp


def test_credentials_are_forwarded_and_nothing_else() -> None:
    request = make_mocked_request(
        "POST", "/v1/completions", headers={"Authorization": "Bearer k", "x-api-key": "k2", "x-other": "no"}
    )
    assert OpenAIApp._metadata(request) == (("authorization", "Bearer k"), ("x-api-key", "k2"))


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("Bearer " + "k" * MAX_CREDENTIAL_CHARS, "longer than"),  # gRPC's 16 KiB limit read as a 429
        ("Bearer été", "printable ASCII"),  # grpc.aio fails the call before it starts: it hung
        ("Bearer a\x7fb", "printable ASCII"),
    ],
)
def test_unusable_credentials_are_invalid_argument(value: str, why: str) -> None:
    request = make_mocked_request("POST", "/v1/completions", headers={"Authorization": value})
    with pytest.raises(InvalidArgument, match=why):
        OpenAIApp._metadata(request)


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_w3c_trace_context_is_forwarded_with_the_credentials() -> None:
    headers = {"Authorization": "Bearer k", "Traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
    request = make_mocked_request("POST", "/v1/completions", headers=headers)
    assert OpenAIApp._metadata(request) == (
        ("authorization", "Bearer k"),
        ("traceparent", TRACEPARENT),
        ("tracestate", "vendor=abc"),
    )


def test_a_malformed_traceparent_is_ignored_not_an_error() -> None:
    headers = {"Authorization": "Bearer k", "traceparent": "00-zz-01", "tracestate": "vendor=abc"}
    request = make_mocked_request("POST", "/v1/completions", headers=headers)
    assert OpenAIApp._metadata(request) == (("authorization", "Bearer k"),)
