"""Tool calls through the HTTP adapter, read by the official ``openai`` client: a scripted gateway
(its Chat frames carry the tool-call deltas the router parsed) behind the real aiohttp app. The
stream must be OpenAI's: the first chunk has the role, ``content: null`` and the call's index, id,
type and name; later chunks only the index and argument fragments; the last, finish_reason
``tool_calls``. Real model, router and Envoy: tests/e2e/test_tools.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from services.common import metadata as md
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http.app import build_app

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
FRAMES = [
    pb.ChatResponse(token_ids=[1], tool_calls=[pb.ToolCallDelta(index=0, id="call_a", name="get_weather")]),
    pb.ChatResponse(token_ids=[2], tool_calls=[pb.ToolCallDelta(index=0, arguments='{"city": ')]),
    pb.ChatResponse(token_ids=[3], tool_calls=[pb.ToolCallDelta(index=0, arguments='"Paris"}')]),
    pb.ChatResponse(token_ids=[4], tool_calls=[pb.ToolCallDelta(index=1, id="call_b", name="get_weather")]),
    pb.ChatResponse(token_ids=[5], tool_calls=[pb.ToolCallDelta(index=1, arguments='{"city": "Rome"}')]),
    pb.ChatResponse(
        final=pb.Final(finish_reason=pb.FINISH_REASON_TOOL_CALLS, usage=pb.Usage(prompt_tokens=9, completion_tokens=5))
    ),
]


class ScriptedChat:
    """A Chat call whose frames are :data:`FRAMES`; records the turn written."""

    def __init__(self, frames: list[pb.ChatResponse], sent: list[pb.ChatRequest]) -> None:
        self._frames = frames
        self._sent = sent

    async def write(self, request: pb.ChatRequest) -> None:
        self._sent.append(request)

    async def done_writing(self) -> None:
        pass

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((md.REQUEST_ID, "req-1"),)

    def cancel(self) -> None:
        pass

    def __aiter__(self) -> AsyncIterator[pb.ChatResponse]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[pb.ChatResponse]:
        for frame in self._frames:
            yield frame


class ScriptedGateway:
    def __init__(self, frames: list[pb.ChatResponse]) -> None:
        self.frames = frames
        self.sent: list[pb.ChatRequest] = []

    def Chat(self, metadata: object = None) -> ScriptedChat:
        return ScriptedChat(self.frames, self.sent)


@pytest.fixture
async def served() -> AsyncIterator[tuple[openai.AsyncOpenAI, ScriptedGateway]]:
    gateway = ScriptedGateway(FRAMES)
    server = TestServer(build_app(gateway), host="127.0.0.1")  # type: ignore[arg-type]
    await server.start_server()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k", max_retries=0)
    try:
        yield client, gateway
    finally:
        await client.close()
        await server.close()


async def test_streamed_tool_calls_are_openais_deltas(served: tuple[openai.AsyncOpenAI, ScriptedGateway]) -> None:
    client, gateway = served
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris and Rome?"}], tools=TOOLS, stream=True
    )
    chunks = [chunk async for chunk in stream]
    (sent,) = gateway.sent
    assert [t.name for t in sent.turn.tools] == ["get_weather"]
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None
    (call,) = first.tool_calls or []
    assert (call.index, call.id, call.type) == (0, "call_a", "function")
    assert call.function is not None and (call.function.name, call.function.arguments) == ("get_weather", "")
    later = [c.choices[0].delta.tool_calls[0] for c in chunks[1:] if c.choices and c.choices[0].delta.tool_calls]
    for delta in later:
        if delta.id is None:
            assert delta.type is None and delta.function is not None and delta.function.name is None
    by_index: dict[int, str] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            by_index[d.index] = by_index.get(d.index, "") + (d.function.arguments or "" if d.function else "")
    assert {i: json.loads(a) for i, a in by_index.items()} == {0: {"city": "Paris"}, 1: {"city": "Rome"}}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


async def test_a_whole_answer_has_message_tool_calls(served: tuple[openai.AsyncOpenAI, ScriptedGateway]) -> None:
    client, _ = served
    reply = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required"
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("call_a", "get_weather", {"city": "Paris"}),
        ("call_b", "get_weather", {"city": "Rome"}),
    ]
    assert reply.usage is not None and reply.usage.completion_tokens == 5


async def test_text_answers_of_a_request_with_tools_open_with_the_role_chunk(
    served: tuple[openai.AsyncOpenAI, ScriptedGateway],
) -> None:
    client, gateway = served
    gateway.frames = [
        pb.ChatResponse(token_ids=[1], text=""),
        pb.ChatResponse(token_ids=[2], text="Sunny."),
        pb.ChatResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP)),
    ]
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, stream=True
    )
    chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks]
    assert (deltas[0].role, deltas[0].content) == ("assistant", "")
    assert deltas[1].content == "Sunny." and not deltas[1].tool_calls
    assert chunks[-1].choices[0].finish_reason == "stop"


CUT = [
    pb.ChatResponse(token_ids=[1], tool_calls=[pb.ToolCallDelta(index=0, id="call_a", name="get_weather")]),
    pb.ChatResponse(token_ids=[2], tool_calls=[pb.ToolCallDelta(index=0, arguments='{"city": "Par')]),
    pb.ChatResponse(
        final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=9, completion_tokens=2))
    ),
]
"""A call cut by max_tokens, as the router parses it: its deltas so far, then FINISH_REASON_LENGTH."""


async def test_a_call_cut_by_max_tokens_is_a_partial_tool_call_with_finish_length(
    served: tuple[openai.AsyncOpenAI, ScriptedGateway],
) -> None:
    """As OpenAI returns it: the partial call in ``tool_calls`` (streamed as argument deltas), ``length``,
    never the call's JSON as content."""
    client, gateway = served
    gateway.frames = CUT
    reply = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required", max_tokens=2
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert (call.id, call.function.name, call.function.arguments) == ("call_a", "get_weather", '{"city": "Par')  # type: ignore[union-attr]
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=2, stream=True
    )
    chunks = [chunk async for chunk in stream]
    pieces = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id == "call_a" and "".join(p.function.arguments or "" for p in pieces if p.function) == (
        '{"city": "Par'
    )
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
