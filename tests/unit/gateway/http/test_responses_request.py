"""Responses bodies -> the Chat turn's pieces (services/gateway/http/responses_request.py)."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.gateway.http.responses_request import chat_turn, parse


def test_function_call_items_join_the_assistant_message_before_them() -> None:
    call = {"type": "function_call", "name": "f", "arguments": "{}"}
    items = [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {**call, "call_id": "call_a"},
        {**call, "call_id": "call_b"},
        {"type": "function_call_output", "call_id": "call_a", "output": [{"type": "input_text", "text": "1"}]},
        {"type": "function_call_output", "call_id": "call_b", "output": "2"},
    ]
    parsed = parse({"input": items, "tools": [{"type": "function", "name": "f"}], "parallel_tool_calls": False})
    turn = chat_turn(parsed, parsed.messages)
    assert [(m.role, m.content, len(m.tool_calls)) for m in turn.messages] == [
        ("user", "hi", 0),
        ("assistant", "Let me look.", 2),
        ("tool", "1", 0),
        ("tool", "2", 0),
    ]
    assert [(m.tool_call_id, m.name) for m in turn.messages[2:]] == [("call_a", "f"), ("call_b", "f")]
    assert [t.name for t in turn.tools] == ["f"] and turn.tool_choice.parallel_tool_calls is False
    assert parsed.parallel_tool_calls is False


def test_formats_and_logprobs() -> None:
    schema = {"type": "object"}
    parsed = parse({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}})
    assert json.loads(parsed.sampling.structured.json_schema) == schema
    assert parsed.text_format["schema"] == schema
    parsed = parse({"input": "x", "top_logprobs": 4, "include": ["message.output_text.logprobs"]})
    assert (parsed.sampling.logprobs, parsed.sampling.top_logprobs, parsed.top_logprobs) == (True, 4, 4)
    assert not parse({"input": "x", "text": {"format": {"type": "text"}}}).sampling.HasField("structured")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tools": [{"type": "file_search"}]}, "'file_search'"),
        ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "'tools[0].strict'"),
        ({"tool_choice": "sometimes"}, "'tool_choice'"),
        ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "'text.format.schema'"),
        ({"text": "json"}, "'text'"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "'input[0].call_id'"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "'input[0].output'"),
        ({"max_tool_calls": 2}, "'max_tool_calls'"),
    ],
)
def test_bad_bodies_name_the_field(body: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidArgument) as caught:
        parse({"input": "x", **body})
    assert needle in str(caught.value)
