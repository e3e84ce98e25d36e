"""The adapter counts every answer by endpoint pattern (bounded labels) and HTTP status, errors too."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY

from services.gateway.http.app import build_app
from tests.unit.gateway.http.test_app_errors import ModelsOnly


@pytest.fixture
async def http() -> AsyncIterator[TestClient]:
    app = build_app(ModelsOnly("org/model-a", "b"))  # type: ignore[arg-type]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


def count(endpoint: str, code: str) -> float:
    value = REGISTRY.get_sample_value("meshserve_http_requests_total", {"endpoint": endpoint, "code": code})
    return value or 0.0


def timed(endpoint: str) -> float:
    value = REGISTRY.get_sample_value("meshserve_http_request_duration_seconds_count", {"endpoint": endpoint})
    return value or 0.0


@pytest.mark.parametrize(
    ("method", "path", "endpoint", "code"),
    [
        ("GET", "/v1/models", "/v1/models", "200"),
        ("GET", "/v1/models/org/model-a", "/v1/models/{model}", "200"),
        ("GET", "/v1/models/missing", "/v1/models/{model}", "404"),
        ("POST", "/v1/chat/completions", "/v1/chat/completions", "400"),  # no body
        ("GET", "/v1/chat/completions", "other", "405"),
        ("GET", "/v1/nothing/here/12345", "other", "404"),  # the path itself never becomes a label
    ],
)
async def test_each_answer_is_counted_by_endpoint_and_code(
    http: TestClient, method: str, path: str, endpoint: str, code: str
) -> None:
    before, before_timed = count(endpoint, code), timed(endpoint)
    response = await http.request(method, path)
    assert str(response.status) == code
    assert count(endpoint, code) == before + 1
    assert timed(endpoint) == before_timed + 1
