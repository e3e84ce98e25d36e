"""``/v1/responses`` with the official ``openai`` client through Envoy, the adapter (with its response store in
the real Redis, a short TTL) and the real gateway, in front of a scripted router (the fake router, plus a tool
call, JSON text or logprobs when the turn asks for them): the request shapes, the streamed events, structured
output, function tools and their calls, logprobs, chains by ``previous_response_id``, tenant isolation,
expiry, refusals; and the adapter-side refusals of ``/v1/embeddings``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.serving import RunningServer
from services.controlplane.frontdoor import FrontDoor
from services.gateway.auth import hash_api_key
from services.gateway.config import GatewaySettings
from services.gateway.server import serve
from tests.helpers import RedisServer
from tests.integration.frontdoor.conftest import API_KEY, INTERNAL_TOKEN, MODEL, WORDS, FakeRouter, sink, start_router

pytestmark = pytest.mark.integration
TEXT = "".join(WORDS)
OTHER_KEY = "msk-frontdoor-other"
TTL_S = 3.0


CALL_ID = "call_0123456789abcdefghijklmn"
ANSWER = {"city": "Paris"}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CUT_AT = 3
"""max_output_tokens that has the scripted router end the call short (FINISH_REASON_LENGTH)."""


class ScriptedRouter(FakeRouter):
    """The fake router, and for a turn whose tool choice asks for a call: one call of the named (or first)
    tool, its arguments in two pieces (then FINISH_REASON_TOOL_CALLS); for a turn with structured output:
    ANSWER as JSON text; with logprobs: each word's logprob and one alternative."""

    async def Chat(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for request in request_iterator:
            if request.WhichOneof("action") != "turn":
                continue
            turn = request.turn
            self.requests.append(request)
            self._check(turn.model)
            usage = pb.Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10)
            if turn.tool_choice.mode in (pb.TOOL_CHOICE_REQUIRED, pb.TOOL_CHOICE_FUNCTION):
                name = turn.tool_choice.function_name or turn.tools[0].name
                text = json.dumps(ANSWER)
                first = pb.ToolCallDelta(index=0, id=CALL_ID, name=name, arguments=text[:5])
                yield pb.ChatResponse(sequence=0, tool_calls=[first])
                if turn.sampling.max_tokens == CUT_AT:  # the router's parse of a call cut by max_tokens
                    length = pb.Final(finish_reason=pb.FINISH_REASON_LENGTH, usage=usage)
                    yield pb.ChatResponse(sequence=1, final=length)
                    continue
                yield pb.ChatResponse(sequence=1, tool_calls=[pb.ToolCallDelta(index=0, arguments=text[5:])])
                yield pb.ChatResponse(
                    sequence=2, final=pb.Final(finish_reason=pb.FINISH_REASON_TOOL_CALLS, usage=usage)
                )
                continue
            pieces = [json.dumps(ANSWER)] if turn.sampling.HasField("structured") else WORDS
            for i, piece in enumerate(pieces):
                logprobs = []
                if turn.sampling.logprobs:
                    top = [pb.TopLogprob(token=" x", token_bytes=b" x", logprob=-2.5)][: turn.sampling.top_logprobs]
                    logprobs = [
                        pb.TokenLogprob(token=piece, token_bytes=piece.encode(), logprob=-0.5, top_logprobs=top)
                    ]
                yield pb.ChatResponse(sequence=i, token_ids=[10 + i], text=piece, logprobs=logprobs)
            yield pb.ChatResponse(sequence=len(pieces), final=self.final())


@dataclass
class Door:
    router: FakeRouter
    door: FrontDoor


@pytest.fixture(scope="module")
async def door(redis_srv: RedisServer) -> AsyncIterator[Door]:
    router = ScriptedRouter()
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
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "'web_search'"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": []}]}, "'tools[0].parameters'"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "'tool_choice'"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text.format.schema"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "'text.format.name'"),
        ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "'text.format'"),
        ({"input": "hi", "top_logprobs": 3}, "'top_logprobs'"),
        ({"input": "hi", "top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "'top_logprobs'"),
        ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "'include'"),
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


async def test_json_schema_format_is_structured_output(client: openai.AsyncOpenAI, door: Door) -> None:
    fmt = {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}
    reply = await client.responses.create(model=MODEL, input="Where?", text={"format": fmt})  # type: ignore[typeddict-item]
    assert json.loads(reply.output_text) == ANSWER
    assert reply.text is not None and reply.text.format is not None and reply.text.format.type == "json_schema"
    assert reply.text.format.schema_ == SCHEMA and reply.text.format.name == "place"  # type: ignore[union-attr]
    structured = door.router.requests[-1].turn.sampling.structured  # type: ignore[attr-defined]
    assert json.loads(structured.json_schema) == SCHEMA
    await client.responses.create(model=MODEL, input="Where?", text={"format": {"type": "json_object"}})
    assert door.router.requests[-1].turn.sampling.structured.HasField("json_object")  # type: ignore[attr-defined]


async def test_required_tool_call_is_a_function_call_item(client: openai.AsyncOpenAI, door: Door) -> None:
    reply = await client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required"
    )  # type: ignore[list-item]
    assert [item.type for item in reply.output] == ["function_call"]
    call = reply.output[0]
    assert call.type == "function_call" and call.call_id == CALL_ID and call.name == "get_weather"
    assert json.loads(call.arguments) == ANSWER and call.status == "completed" and reply.status == "completed"
    assert reply.tools[0].name == "get_weather" and reply.tool_choice == "required"  # type: ignore[union-attr]
    turn = door.router.requests[-1].turn  # type: ignore[attr-defined]
    assert [t.name for t in turn.tools] == ["get_weather"] and turn.tool_choice.mode == pb.TOOL_CHOICE_REQUIRED
    assert json.loads(turn.tools[0].parameters_json) == WEATHER["parameters"]

    stream = await client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        stream=True,
    )
    events = [event async for event in stream]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2].item, events[6].item  # type: ignore[union-attr]
    assert added.type == "function_call" and added.call_id == CALL_ID and added.status == "in_progress"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == ANSWER and events[5].arguments == deltas  # type: ignore[union-attr]
    assert done.type == "function_call" and done.arguments == deltas and done.status == "completed"
    assert events[-1].response.output[0].call_id == CALL_ID  # type: ignore[union-attr]
    assert door.router.requests[-1].turn.tool_choice.function_name == "get_weather"  # type: ignore[attr-defined]


async def test_a_call_cut_by_max_output_tokens_is_an_incomplete_function_call(client: openai.AsyncOpenAI) -> None:
    """As OpenAI: the partial call in the output (never text), the response incomplete for max_output_tokens."""
    reply = await client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=CUT_AT
    )  # type: ignore[list-item]
    assert reply.status == "incomplete" and reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    (call,) = reply.output
    assert call.type == "function_call" and call.call_id == CALL_ID and call.status == "incomplete"
    assert call.arguments == json.dumps(ANSWER)[:5] and reply.output_text == ""
    stream = await client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=CUT_AT,
        stream=True,
    )
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" not in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == json.dumps(ANSWER)[:5]
    done = next(e.item for e in events if e.type == "response.output_item.done")  # type: ignore[union-attr]
    assert done.type == "function_call" and done.status == "incomplete"


async def test_function_call_output_in_the_next_turn(client: openai.AsyncOpenAI, door: Door) -> None:
    first = await client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required"
    )  # type: ignore[list-item]
    result = {"type": "function_call_output", "call_id": CALL_ID, "output": "sunny, 21 C"}
    second = await client.responses.create(model=MODEL, input=[result], tools=[WEATHER], previous_response_id=first.id)  # type: ignore[list-item]
    assert second.output_text == TEXT
    turn = door.router.requests[-1].turn  # type: ignore[attr-defined]
    assert [(m.role, m.content) for m in turn.messages] == [
        ("user", "Weather in Paris?"),
        ("assistant", ""),
        ("tool", "sunny, 21 C"),
    ]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in turn.messages[1].tool_calls] == [
        (CALL_ID, "get_weather", ANSWER)
    ]
    assert (turn.messages[2].tool_call_id, turn.messages[2].name) == (CALL_ID, "get_weather")

    # The same conversation sent whole in `input`, as a client without stored responses does.
    call = {"type": "function_call", "call_id": CALL_ID, "name": "get_weather", "arguments": json.dumps(ANSWER)}
    items = [{"role": "user", "content": "Weather in Paris?"}, call, result]
    await client.responses.create(model=MODEL, input=items, tools=[WEATHER], store=False)  # type: ignore[arg-type,list-item]
    again = door.router.requests[-1].turn  # type: ignore[attr-defined]
    assert list(again.messages) == list(turn.messages)


async def test_top_logprobs_with_include(client: openai.AsyncOpenAI) -> None:
    include = ["message.output_text.logprobs"]
    reply = await client.responses.create(model=MODEL, input="Hi", top_logprobs=1, include=include)  # type: ignore[list-item]
    part = reply.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [(w, -0.5) for w in WORDS]
    assert [t.token for t in part.logprobs[0].top_logprobs] == [" x"] and reply.top_logprobs == 1
    stream = await client.responses.create(model=MODEL, input="Hi", top_logprobs=0, include=include, stream=True)  # type: ignore[list-item]
    events = [event async for event in stream]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [[lp.token for lp in e.logprobs] for e in deltas] == [[w] for w in WORDS]
    assert all(not lp.top_logprobs for e in deltas for lp in e.logprobs)
