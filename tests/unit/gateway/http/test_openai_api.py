"""OpenAI JSON <-> proto translation and the error mapping (every branch)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http import openai_api as oa


def test_chat_request_maps_messages_sampling_and_stream_options() -> None:
    parsed, request = oa.chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
            ],
            "max_completion_tokens": 9,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 7,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert parsed == oa.Parsed(model="m", stream=True, include_usage=True)
    turn = request.turn
    assert [(m.role, m.content) for m in turn.messages] == [("system", "Be brief."), ("user", "Hello")]
    assert (turn.model, turn.sampling.max_tokens, turn.sampling.temperature) == ("m", 9, 0.0)
    assert turn.sampling.top_p == 0.5 and turn.sampling.seed == 7 and list(turn.sampling.stop) == ["\n"]


def test_defaults_follow_openai() -> None:
    _, request = oa.completion_request({"prompt": ["one prompt"]})
    assert request.prompt == "one prompt"
    assert request.sampling.temperature == 1.0  # OpenAI's default, not our greedy 0
    assert not request.sampling.HasField("seed") and request.sampling.max_tokens == 0


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "n": 2},
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        {"messages": [{"role": "user", "content": "x"}], "stop": [1]},
        {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
        {"messages": [{"role": "user", "content": "x"}], "model": 3},
    ],
)
def test_bad_chat_requests_are_invalid_argument(body: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        oa.chat_request(body)


def test_completion_needs_one_string_prompt() -> None:
    with pytest.raises(InvalidArgument):
        oa.completion_request({"prompt": ["a", "b"]})


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
    got_status, body = oa.error_body(code, "what went wrong")
    assert got_status == status
    assert body["error"]["type"] == kind and body["error"]["message"] == "what went wrong"


@pytest.mark.parametrize(("ms", "seconds"), [(0, 1), (1, 1), (1000, 1), (1001, 2), (2300, 3)])
def test_retry_after_is_whole_seconds_rounded_up(ms: int, seconds: int) -> None:
    assert oa.retry_after_s(ms) == seconds


def test_responses_carry_usage_and_finish_reason() -> None:
    final = pb.Final(
        finish_reason=pb.FINISH_REASON_STOP_STRING, usage=pb.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    )
    chat = oa.chat_completion("rid", "m", "hi", final)
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"]["total_tokens"] == 5
    chunk = oa.completion("rid", "m", "x", None, created=1)
    assert chunk["choices"][0]["finish_reason"] is None and "usage" not in chunk
    assert oa.usage_chunk("chat.completion.chunk", "rid", "m", final, 1)["choices"] == []
