"""``/v1/responses`` with the official ``openai`` client through Envoy, the adapter (with its response store in
the real Redis, a short TTL) and the real gateway, in front of the fake router: the request shapes, the
streamed events, chains by ``previous_response_id``, tenant isolation, expiry, refusals; and the
adapter-side refusals of ``/v1/embeddings``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import pytest

from services.common.serving import RunningServer
from services.controlplane.frontdoor import FrontDoor
from services.gateway.__main__ import serve
from services.gateway.auth import hash_api_key
from services.gateway.config import GatewaySettings
from tests.helpers import RedisServer
from tests.integration.frontdoor.conftest import API_KEY, INTERNAL_TOKEN, MODEL, WORDS, FakeRouter, sink, start_router

pytestmark = pytest.mark.integration
TEXT = "".join(WORDS)
OTHER_KEY = "msk-frontdoor-other"
TTL_S = 3.0


@dataclass
class Door:
    router: FakeRouter
    door: FrontDoor


@pytest.fixture(scope="module")
async def door(redis_srv: RedisServer) -> AsyncIterator[Door]:
    router = FakeRouter()
    router_server = await start_router(router)
    settings = GatewaySettings(
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        router_address=f"127.0.0.1:{router_server.port}",
        api_keys=f"acme:{hash_api_key(API_KEY)},other:{hash_api_key(OTHER_KEY)}",
        redis_url=redis_srv.url,
        internal_token=INTERNAL_TOKEN,
        shutdown_grace_s=0.5,
    )
    gateway: RunningServer = await serve(settings)
    env = {"MESHSERVE_GATEWAY_HTTP_REDIS_URL": redis_srv.url, "MESHSERVE_GATEWAY_HTTP_RESPONSES_TTL_S": str(TTL_S)}
    try:
        async with FrontDoor([f"127.0.0.1:{gateway.port}"], sink, env=env) as running:
            yield Door(router, running)
    finally:
        await gateway.stop()
        await router_server.stop()


@pytest.fixture
async def client(door: Door) -> AsyncIterator[openai.AsyncOpenAI]:
    door.router.mode = "ok"
    door.router.requests.clear()
    async with openai.AsyncOpenAI(base_url=door.door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def sent(router: FakeRouter) -> list[tuple[str, str]]:
    turn = router.requests[-1].turn  # type: ignore[attr-defined]
    return [(m.role, m.content) for m in turn.messages]


async def test_plain_and_instructions(client: openai.AsyncOpenAI, door: Door) -> None:
    reply = await client.responses.create(model=MODEL, input="Say hello", max_output_tokens=8, temperature=0)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == TEXT
    assert reply.status == "incomplete"  # the fake router ends with FINISH_REASON_LENGTH
    assert reply.incomplete_details is not None and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None and (reply.usage.input_tokens, reply.usage.output_tokens) == (7, 3)
    assert sent(door.router) == [("user", "Say hello")]
    turn = door.router.requests[-1].turn  # type: ignore[attr-defined]
    assert turn.sampling.max_tokens == 8 and turn.sampling.temperature == 0

    await client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
    )
    assert sent(door.router) == [("system", "Be brief."), ("user", "Hi")]


async def test_streaming_events_in_openai_order(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model=MODEL, input="Say hello", stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(WORDS),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT
    last = events[-1].response  # type: ignore[union-attr]
    assert last.output_text == TEXT and last.usage is not None and last.usage.output_tokens == 3
    # The streamed response is stored like any other.
    assert (await client.responses.retrieve(last.id)).output_text == TEXT


async def test_previous_response_id_chains_turns_and_get_delete(client: openai.AsyncOpenAI, door: Door) -> None:
    first = await client.responses.create(model=MODEL, instructions="Be brief.", input="My name is Ada.")
    second = await client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The first turn's input and output come before the new input; its instructions do not carry over.
    assert sent(door.router) == [("user", "My name is Ada."), ("assistant", TEXT), ("user", "What is my name?")]
    third = await client.responses.create(model=MODEL, input="And again?", previous_response_id=second.id)
    assert len(sent(door.router)) == 5
    assert (await client.responses.retrieve(third.id)).output_text == TEXT
    await client.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(third.id)


async def test_store_false_keeps_nothing(client: openai.AsyncOpenAI) -> None:
    reply = await client.responses.create(model=MODEL, input="Hi", store=False)
    assert reply.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(reply.id)


async def test_another_tenant_gets_404(client: openai.AsyncOpenAI, door: Door) -> None:
    mine = await client.responses.create(model=MODEL, input="A secret")
    async with openai.AsyncOpenAI(base_url=door.door.base_url, api_key=OTHER_KEY, max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.create(model=MODEL, input="Go on", previous_response_id=mine.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.delete(mine.id)
    assert (await client.responses.retrieve(mine.id)).output_text == TEXT  # still there for its tenant


async def test_expired_response_is_404(client: openai.AsyncOpenAI) -> None:
    reply = await client.responses.create(model=MODEL, input="Hi")
    await client.responses.retrieve(reply.id)
    deadline = time.monotonic() + TTL_S + 5
    while True:  # Redis expires the record TTL_S after it was written
        try:
            await client.responses.retrieve(reply.id)
        except openai.NotFoundError:
            break
        assert time.monotonic() < deadline, "the stored response outlived its TTL"
        await asyncio.sleep(0.25)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL, input="Go on", previous_response_id=reply.id)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": ""}, "'input'"),
        ({"input": []}, "'input'"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "'tools'"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "'text.format'"),
        ({"input": "hi", "max_output_tokens": 0}, "'max_output_tokens'"),
        ({"input": "hi", "temperature": "hot"}, "'temperature'"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "max_output_tokens": 100_000}, "max_tokens"),
        ({"input": "hi", "stream": "yes"}, "'stream'"),
        ({"input": "hi", "previous_response_id": 7}, "'previous_response_id'"),
        ({"input": "hi", "background": True}, "'background'"),
    ],
)
async def test_bad_requests_are_400_naming_the_field(client: openai.AsyncOpenAI, body: dict, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.post("/responses", body={"model": MODEL, **body}, cast_to=object)
    assert field in str(caught.value)


async def test_unknown_previous_response_is_404(client: openai.AsyncOpenAI) -> None:
    for previous in ("resp_0123abcd", "not-an-id"):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.create(model=MODEL, input="Hi", previous_response_id=previous)
        assert previous in str(caught.value)


async def test_wrong_key_is_401(door: Door) -> None:
    async with openai.AsyncOpenAI(base_url=door.door.base_url, api_key="msk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.responses.create(model=MODEL, input="Hi")
        with pytest.raises(openai.AuthenticationError):
            await bad.responses.retrieve("resp_00")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": ""}, "'input[0]'"),
        ({"input": []}, "'input'"),
        ({"input": [[1, 2], "x", 3]}, "'input[2]'"),
        ({"input": [[-1]]}, "'input[0]'"),
        ({"input": "x", "encoding_format": "int8"}, "'encoding_format'"),
        ({"input": "x", "dimensions": 0}, "'dimensions'"),
        ({"input": ["x"] * 2049}, "inputs has 2049 entries"),
    ],
)
async def test_embeddings_bad_requests_are_400(client: openai.AsyncOpenAI, body: dict, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.post("/embeddings", body={"model": MODEL, **body}, cast_to=object)
    assert field in str(caught.value)
