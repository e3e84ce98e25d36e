"""``GET /v1/models`` and ``/v1/models/{model}`` show each model's generation defaults (what a request that
leaves a sampling field unset gets), as the router lists them over ListModels."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http.app import build_app


class Listed:
    async def ListModels(self, request: pb.ListModelsRequest, metadata: object = None) -> pb.ListModelsResponse:
        card = pb.GenerationDefaults(temperature=0.2, top_p=0.9, max_tokens=64, stop=["\n\n"])
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id="card", generation_defaults=card, state="asleep"), pb.ModelInfo(id="plain")]
        )


@pytest.fixture
async def http() -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(build_app(Listed()), host="127.0.0.1")) as client:  # type: ignore[arg-type]
        yield client


async def test_the_model_list_shows_each_models_generation_defaults(http: TestClient) -> None:
    body = await (await http.get("/v1/models")).json()
    card, plain = body["data"]
    assert card["generation_defaults"] == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 64, "stop": ["\n\n"]}
    assert plain["generation_defaults"] == {}  # none of its own: the mesh's neutral values apply
    assert {k: card[k] for k in ("id", "object", "owned_by")} == {
        "id": "card",
        "object": "model",
        "owned_by": "meshserve",
    }
    one = await (await http.get("/v1/models/card")).json()
    assert one["generation_defaults"] == card["generation_defaults"]


def test_an_explicit_zero_default_is_shown() -> None:
    from services.gateway.http.openai_reply import generation_defaults

    assert generation_defaults(pb.GenerationDefaults(temperature=0.0, top_k=0)) == {"temperature": 0.0, "top_k": 0}


async def test_the_model_list_shows_a_sleeping_models_state(http: TestClient) -> None:
    body = await (await http.get("/v1/models")).json()
    card, plain = body["data"]
    assert card["state"] == "asleep"  # listed while asleep: its first request wakes it
    assert "state" not in plain  # a router that says nothing of it
