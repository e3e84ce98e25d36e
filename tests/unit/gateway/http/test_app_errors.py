"""The adapter's own refusals (body it cannot read, no route, wrong method, too large): OpenAI error JSON, never 500.

The aiohttp app runs on a loopback port with a stand-in gateway stub (only ListModels is called); the
same requests through Envoy and the real gateway are in tests/integration/frontdoor/test_openai.py.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http.app import build_app

MAX_BODY = 64 * 1024


class ModelsOnly:
    """The one gateway method these requests reach."""

    def __init__(self, *ids: str) -> None:
        self.ids = ids

    async def ListModels(self, request: pb.ListModelsRequest, metadata: object = None) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=i) for i in self.ids])


@pytest.fixture
async def http() -> AsyncIterator[TestClient]:
    app = build_app(ModelsOnly("org/model-a", "b"), max_body_bytes=MAX_BODY)  # type: ignore[arg-type]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


async def error(response: object) -> dict[str, object]:
    body = await response.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("data", "headers"),
    [
        (b"[" * 20_000 + b"]" * 20_000, {}),  # json.loads' RecursionError was a 500
        (b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", {}),
        (b"not gzip at all", {"Content-Encoding": "gzip"}),  # aiohttp's RequestPayloadError was a 500
        (b"\xff\xfe", {}),
    ],
)
async def test_a_body_that_cannot_be_read_as_json_is_400(
    http: TestClient, data: bytes, headers: dict[str, str]
) -> None:
    response = await http.post("/v1/chat/completions", data=data, headers=headers)
    assert response.status == 400
    err = await error(response)
    assert err["type"] == "invalid_request_error" and "request body" in str(err["message"])


async def test_a_gzip_body_is_read(http: TestClient) -> None:
    """Decoding works, so the refusal above is about the bad encoding (this one fails later: no messages)."""
    data = gzip.compress(json.dumps({"messages": []}).encode())
    response = await http.post("/v1/chat/completions", data=data, headers={"Content-Encoding": "gzip"})
    assert response.status == 400
    assert "'messages' must be a non-empty list" in str((await error(response))["message"])


async def test_unknown_endpoint_is_404_without_a_model_code(http: TestClient) -> None:
    response = await http.post("/v1/audio/speech", json={"input": "x"})  # (/v1/embeddings is served now)
    assert response.status == 404
    err = await error(response)
    assert err["code"] is None  # it said model_not_found
    assert "unknown endpoint POST /v1/audio/speech" in str(err["message"])
    assert "/v1/chat/completions" in str(err["message"])


async def test_wrong_method_is_405_naming_the_allowed_one(http: TestClient) -> None:
    response = await http.get("/v1/chat/completions")
    assert response.status == 405
    assert response.headers["Allow"] == "POST"
    assert "takes POST" in str((await error(response))["message"])


async def test_body_over_the_limit_is_413_naming_it(http: TestClient) -> None:
    response = await http.post("/v1/completions", data=b"x" * (MAX_BODY + 1))
    assert response.status == 413
    assert f"larger than {MAX_BODY} bytes" in str((await error(response))["message"])


async def test_a_model_id_with_a_slash_can_be_retrieved(http: TestClient) -> None:
    response = await http.get("/v1/models/org/model-a")
    assert response.status == 200
    assert (await response.json())["id"] == "org/model-a"
    missing = await http.get("/v1/models/org/other")
    assert missing.status == 404 and (await error(missing))["code"] == "model_not_found"


class WakingUp:
    """A gateway whose router answers that the model is still waking up."""

    def __init__(self, retry_ms: str | None) -> None:
        self.retry_ms = retry_ms

    async def ListModels(self, request: pb.ListModelsRequest, metadata: object = None) -> pb.ListModelsResponse:
        import grpc

        trailers = grpc.aio.Metadata(*([("retry-after-ms", self.retry_ms)] if self.retry_ms is not None else []))
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            trailers,
            "model 'a' is waking up and did not become ready within 60 s; retry after 5 s",
        )


@pytest.mark.parametrize(("retry_ms", "header"), [("4500", "5"), ("5000", "5"), (None, None)])
async def test_unavailable_with_a_retry_after_is_503_with_a_retry_after_header(
    retry_ms: str | None, header: str | None
) -> None:
    async with TestClient(TestServer(build_app(WakingUp(retry_ms)), host="127.0.0.1")) as client:  # type: ignore[arg-type]
        response = await client.get("/v1/models")
        assert response.status == 503
        assert response.headers.get("Retry-After") == header  # seconds, rounded up
        err = await error(response)
        assert err["type"] == "service_unavailable" and "'a' is waking up" in str(err["message"])


def test_an_unavailable_domain_error_with_a_retry_after_is_503_with_the_header() -> None:
    from services.common.errors import Unavailable
    from services.gateway.http.app import error_response

    response = error_response(Unavailable("model 'a' could not wake up", retry_after_ms=1200))
    assert response.status == 503
    assert response.headers["Retry-After"] == "2" and response.headers["retry-after-ms"] == "1200"
    assert "Retry-After" not in error_response(Unavailable("no backend")).headers
