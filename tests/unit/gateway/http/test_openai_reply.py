"""Proto -> OpenAI answer JSON, chunks, usage and logprobs, and the error mapping (every branch)
(services/gateway/http/openai_reply.py)."""

from __future__ import annotations

import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http import openai_reply


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("INVALID_ARGUMENT", 400, "invalid_request_error"),
        ("UNAUTHENTICATED", 401, "authentication_error"),
        ("PERMISSION_DENIED", 403, "permission_error"),
        ("NOT_FOUND", 404, "not_found_error"),
        ("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
        ("CANCELLED", 499, "cancelled"),
        ("INTERNAL", 500, "server_error"),
        ("UNAVAILABLE", 503, "service_unavailable"),
        ("DEADLINE_EXCEEDED", 504, "timeout"),
        ("SOMETHING_NEW", 500, "server_error"),
    ],
)
def test_error_body(code: str, status: int, kind: str) -> None:
    got_status, body = openai_reply.error_body(code, "what went wrong")
    assert got_status == status
    assert body["error"]["type"] == kind and body["error"]["message"] == "what went wrong"


@pytest.mark.parametrize(("ms", "seconds"), [(0, 1), (1, 1), (1000, 1), (1001, 2), (2300, 3)])
def test_retry_after_is_whole_seconds_rounded_up(ms: int, seconds: int) -> None:
    assert openai_reply.retry_after_s(ms) == seconds


def test_responses_carry_usage_and_finish_reason() -> None:
    final = pb.Final(
        finish_reason=pb.FINISH_REASON_STOP_STRING, usage=pb.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    )
    chat = openai_reply.chat_completion("rid", "m", "hi", final)
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"]["total_tokens"] == 5
    chunk = openai_reply.completion("rid", "m", "x", None, created=1)
    assert chunk["choices"][0]["finish_reason"] is None and "usage" not in chunk
    assert openai_reply.usage_chunk("chat.completion.chunk", "rid", "m", final, 1)["choices"] == []


def test_stream_chunks_carry_null_usage_when_usage_is_asked_for() -> None:
    assert "usage" not in openai_reply.chat_chunk("rid", "m", {"content": "a"}, None, 1)
    assert openai_reply.chat_chunk("rid", "m", {"content": "a"}, None, 1, include_usage=True)["usage"] is None
    assert openai_reply.completion("rid", "m", "a", None, 1, with_usage=False, null_usage=True)["usage"] is None
    assert "usage" not in openai_reply.completion("rid", "m", "a", None, 1, with_usage=False)


def test_tool_call_deltas_are_openais_stream_shape() -> None:
    deltas = [
        pb.ToolCallDelta(index=0, id="call_1", name="get_weather", arguments=""),
        pb.ToolCallDelta(index=0, arguments='{"city"'),
        pb.ToolCallDelta(index=1, id="call_2", name="add", arguments="{}"),
    ]
    assert openai_reply.tool_call_deltas(deltas) == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city"'}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "add", "arguments": "{}"}},
    ]
    final = pb.Final(finish_reason=pb.FINISH_REASON_TOOL_CALLS)
    body = openai_reply.chat_completion("r", "m", "", final, [*deltas, pb.ToolCallDelta(index=0, arguments=': "P"}')])
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": "{}"}},
        ],
    }


def _entries() -> list[pb.TokenLogprob]:
    hello = pb.TokenLogprob(token_id=1, token="Hi", token_bytes=b"Hi", logprob=-0.25)
    hello.top_logprobs.add(token_id=1, token="Hi", token_bytes=b"Hi", logprob=-0.25)
    hello.top_logprobs.add(token_id=2, token=" yo", token_bytes=b" yo", logprob=float("-inf"))
    part = pb.TokenLogprob(token_id=3, token="bytes:\\xe6", token_bytes=b"\xe6", logprob=-1.5)
    return [hello, part]


def test_chat_logprobs_have_openai_s_shape() -> None:
    body = openai_reply.chat_completion("r", "m", "Hi", pb.Final(), logprobs=_entries())
    content = body["choices"][0]["logprobs"]["content"]
    assert body["choices"][0]["logprobs"]["refusal"] is None
    assert content[0] == {
        "token": "Hi",
        "logprob": -0.25,
        "bytes": [72, 105],
        "top_logprobs": [
            {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
            {"token": " yo", "logprob": -9999.0, "bytes": [32, 121, 111]},  # -inf: OpenAI's floor
        ],
    }
    assert content[1]["bytes"] == [0xE6] and content[1]["top_logprobs"] == []
    assert openai_reply.chat_completion("r", "m", "Hi", pb.Final())["choices"][0]["logprobs"] is None
    chunk = openai_reply.chat_chunk("r", "m", {"content": "Hi"}, None, 0, False, logprobs=_entries()[:1])
    assert chunk["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"


def test_completion_logprobs_have_openai_s_shape() -> None:
    got = openai_reply.completion_logprobs(_entries(), offset=4)
    assert got == {
        "tokens": ["Hi", "bytes:\\xe6"],
        "token_logprobs": [-0.25, -1.5],
        "top_logprobs": [{"Hi": -0.25, " yo": -9999.0}, {"bytes:\\xe6": -1.5}],  # the sampled token always in
        "text_offset": [4, 6],
    }


def test_a_budget_closed_answer_is_marked_in_the_usage_details() -> None:
    closed = pb.Final(
        finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=3, completion_tokens=9, budget_closed=True)
    )
    plain = pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=3, completion_tokens=4))
    assert openai_reply.usage(closed)["completion_tokens_details"] == {"budget_closed": True}
    assert "completion_tokens_details" not in openai_reply.usage(plain)
    assert openai_reply.usage([plain, closed])["completion_tokens_details"] == {"budget_closed": True}  # n choices
    assert openai_reply.chat_completion("rid", "m", "{}", closed)["usage"]["completion_tokens_details"]["budget_closed"]
