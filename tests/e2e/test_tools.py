"""Tools on the real model: through the public gRPC API (Chat with tools, tool choice, tool messages in
the next turn) and through the official ``openai`` client via Envoy, streaming and not.

SmolLM2-135M-Instruct's template knows no tools: they reach it through the documented fallback
rendering (services/common/chat_tools.py), and the unconstrained 135M model answers them with text.
The parse / stream path with calls in the output is covered with scripted output in
tests/unit/router/frontend/test_api.py, test_tool_parser.py and tests/unit/gateway/http/test_app_tools.py.
The tests that need calls from the real model need the tool constraint applied to the generation
(services/router/tools.py, ``constrained``), applied since the structured-output merge (``CONSTRAINT_APPLIED``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import openai
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.controlplane.frontdoor import FrontDoor
from services.router.tools import CONSTRAINT_APPLIED
from tests.e2e.conftest import API_KEY, auth

pytestmark = pytest.mark.e2e
NEEDS_CONSTRAINT = pytest.mark.skipif(
    not CONSTRAINT_APPLIED,
    reason="needs the tool constraint wired into SamplingParams' structured output (field 28, the structured-output "
    "work): services/router/tools.py constrained() is still the identity",
)
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = pb.Tool(
    name="get_weather", description="The current weather in a city", parameters_json=json.dumps(PARAMETERS)
)
QUESTION = pb.ChatMessage(role="user", content="What is the weather in Paris?")
GREEDY = pb.SamplingParams(max_tokens=12)  # temperature 0: greedy
NO_CACHE = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)


def turn(*messages: pb.ChatMessage, routing: pb.RoutingOptions = NO_CACHE, **kw: Any) -> pb.ChatRequest:
    return pb.ChatRequest(turn=pb.ChatTurn(messages=messages, sampling=GREEDY, routing=routing, **kw))


async def chat(gateway, *turns: pb.ChatRequest) -> list[tuple[str, list[pb.ToolCallDelta], pb.Final]]:  # type: ignore[no-untyped-def]
    """Each turn's text, tool-call deltas and final, the turns sent one after the other on one stream."""

    async def frames() -> AsyncIterator[pb.ChatRequest]:
        for request in turns:
            yield request

    out: list[tuple[str, list[pb.ToolCallDelta], pb.Final]] = []
    text, deltas = "", []
    async for frame in gateway.Chat(frames(), metadata=auth()):
        text += frame.text
        deltas.extend(frame.tool_calls)
        if frame.HasField("final"):
            out.append((text, deltas, frame.final))
            text, deltas = "", []
    return out


def calls_of(deltas: list[pb.ToolCallDelta]) -> list[tuple[str, str, str]]:
    """Deltas as a client accumulates them; each call's first delta has its id and name."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id:
            assert d.index not in calls and d.name
            calls[d.index] = [d.id, d.name, d.arguments]
        else:
            assert d.index in calls and not d.name
            calls[d.index][2] += d.arguments
    return [(i, n, a) for i, n, a in (calls[k] for k in sorted(calls))]


def assert_well_formed(text: str, deltas: list[pb.ToolCallDelta], final: pb.Final) -> None:
    calls = calls_of(deltas)
    assert all(name == "get_weather" for _, name, _ in calls)
    if final.finish_reason == pb.FINISH_REASON_TOOL_CALLS:
        assert calls
    elif calls:  # a call the budget cut: returned as a call, with finish_reason length (never as content)
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert "<tool_call>" not in text


async def test_a_turn_with_tools_and_the_tool_result_in_the_next_turn(gateway) -> None:  # type: ignore[no-untyped-def]
    first, second = await chat(
        gateway,
        turn(QUESTION, tools=[WEATHER]),
        turn(
            pb.ChatMessage(
                role="assistant",
                tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')],
            ),
            pb.ChatMessage(role="tool", tool_call_id="call_1", content='{"temperature_c": 21, "sky": "sunny"}'),
            tools=[WEATHER],
        ),
    )
    assert_well_formed(*first)
    assert_well_formed(*second)
    # the second turn's prompt holds the first turn, its answer, the call and its result
    assert second[2].usage.prompt_tokens > first[2].usage.prompt_tokens + 20


async def test_tool_choice_none_never_calls_and_renders_no_tools(gateway) -> None:  # type: ignore[no-untyped-def]
    none = pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE)
    ((text, deltas, final),) = await chat(gateway, turn(QUESTION, tools=[WEATHER], tool_choice=none))
    ((plain, _, without),) = await chat(gateway, turn(QUESTION))
    ((_, _, auto),) = await chat(gateway, turn(QUESTION, tools=[WEATHER]))
    assert not deltas and final.finish_reason != pb.FINISH_REASON_TOOL_CALLS
    assert (text, final.usage.prompt_tokens) == (plain, without.usage.prompt_tokens)
    assert auto.usage.prompt_tokens > without.usage.prompt_tokens  # with auto the tools are in the prompt


async def test_tools_and_tool_choice_are_part_of_the_cache_key(gateway) -> None:  # type: ignore[no-untyped-def]
    cached = pb.RoutingOptions(tier=pb.TIER_EDGE)
    question = pb.ChatMessage(role="user", content="Weather in Oslo, please?")
    ((_, _, auto),) = await chat(gateway, turn(question, routing=cached, tools=[WEATHER]))
    ((_, _, again),) = await chat(gateway, turn(question, routing=cached, tools=[WEATHER]))
    assert not auto.route.cache_hit and again.route.cache_hit
    required = pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED)  # the same prompt: only the key tells them apart
    ((_, _, other),) = await chat(gateway, turn(question, routing=cached, tools=[WEATHER], tool_choice=required))
    assert other.usage.prompt_tokens == auto.usage.prompt_tokens and not other.route.cache_hit


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tools": [pb.Tool(name=f"f{i}") for i in range(129)]}, "tools has 129 entries; send at most 128"),
        (
            {"tools": [WEATHER], "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_FUNCTION, function_name="nope")},
            "tool_choice names function 'nope'",
        ),
        ({"tools": [pb.Tool(name="f", parameters_json="{")]}, "tools[0].function.parameters is not valid JSON"),
        ({"tools": [pb.Tool(name="f", parameters_json="x" * 16385)]}, "above the limit of 16384"),
    ],
)
async def test_bad_tools_are_invalid_argument_naming_the_field(gateway, fields: dict[str, Any], needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chat(gateway, turn(QUESTION, **fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (info.value.details() or "")


@NEEDS_CONSTRAINT
@pytest.mark.parametrize(
    "choice",
    [
        pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
        pb.ToolChoice(mode=pb.TOOL_CHOICE_FUNCTION, function_name="get_weather"),
    ],
    ids=["required", "named"],
)
async def test_required_and_named_choices_call_with_schema_valid_arguments(gateway, choice: pb.ToolChoice) -> None:  # type: ignore[no-untyped-def]
    import jsonschema

    sampling = pb.SamplingParams(max_tokens=48)
    request = pb.ChatRequest(
        turn=pb.ChatTurn(messages=[QUESTION], sampling=sampling, routing=NO_CACHE, tools=[WEATHER], tool_choice=choice)
    )
    ((text, deltas, final),) = await chat(gateway, request)
    calls = calls_of(deltas)
    assert calls and final.finish_reason == pb.FINISH_REASON_TOOL_CALLS and not text.strip()
    for _, name, arguments in calls:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), PARAMETERS)


# -- the official openai client through Envoy ------------------------------------------------------------

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": WEATHER.description, "parameters": PARAMETERS},
    }
]
MESSAGES: list[Any] = [{"role": "user", "content": QUESTION.content}]


@pytest.fixture
async def client(door: FrontDoor) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


async def both(client: openai.AsyncOpenAI, **kw: Any) -> tuple[Any, str, list[tuple[str, str]], str | None]:
    """Non-streamed and streamed answers of one request: the same content and calls (ids aside).
    Returns (the whole message, the streamed content, the streamed calls, the streamed finish reason)."""
    args = {"model": "", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "tools": TOOLS, **kw}
    reply = await client.chat.completions.create(**args)
    stream = await client.chat.completions.create(**args, stream=True)
    content, calls, finish = "", {}, None
    first = True
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if first:
            assert delta.role == "assistant"
            first = False
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id:
                assert d.type == "function" and d.function and d.function.name
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                assert d.function and d.function.name is None
                calls[d.index][1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    message = reply.choices[0].message
    whole = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[union-attr]
    streamed = [(n, a) for n, a in (calls[k] for k in sorted(calls))]
    assert (message.content or "", whole, reply.choices[0].finish_reason) == (content, streamed, finish)
    return message, content, streamed, finish


async def test_tools_through_the_openai_client_stream_and_not(client: openai.AsyncOpenAI) -> None:
    _, content, calls, finish = await both(client)
    assert content or calls
    assert finish in ("stop", "length", "tool_calls")
    assert finish != "tool_calls" or calls
    assert not calls or finish in ("tool_calls", "length")  # a call the budget cut is still a call
    assert "<tool_call>" not in content
    none, _, none_calls, none_finish = await both(client, tool_choice="none")
    assert none.tool_calls is None and not none_calls and none_finish != "tool_calls"
    single, *_ = await both(client, parallel_tool_calls=False)
    assert len(single.tool_calls or []) <= 1


async def test_a_tool_result_in_the_next_request(client: openai.AsyncOpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "sunny"}'},
    ]
    reply = await client.chat.completions.create(model="", messages=messages, max_tokens=12, temperature=0, tools=TOOLS)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage is not None and reply.usage.prompt_tokens > 150  # tools, call and result rendered


async def test_bad_tools_are_400_naming_the_field(client: openai.AsyncOpenAI) -> None:
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    for kw, needle in (
        ({"tools": many}, "tools has 129 entries; send at most 128"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice names function 'nope'",
        ),
        ({"tool_choice": "required"}, "tool_choice is 'required' but the request has no tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "only function tools are supported"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool message without tool_call_id"),
    ):
        args = {"model": "", "messages": MESSAGES, "max_tokens": 4, **kw}
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(**args)
        assert needle in str(info.value), kw


@NEEDS_CONSTRAINT
async def test_required_calls_through_the_openai_client(client: openai.AsyncOpenAI) -> None:
    import jsonschema

    message, _, calls, finish = await both(client, tool_choice="required", max_tokens=48)
    assert finish == "tool_calls" and calls and message.content is None
    for name, arguments in calls:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), PARAMETERS)
