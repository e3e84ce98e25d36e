"""A batch line's body becomes the request the HTTP API would send, or the same clear error."""

from __future__ import annotations

import json

import pytest

from services.batch import lines
from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.validation import Limits

LIMITS = Limits(max_tokens=64)


def test_chat_and_completion_bodies_run_at_priority_zero() -> None:
    chat = lines.request_for(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}, LIMITS
    )
    assert isinstance(chat, pb.ChatRequest) and chat.turn.routing.priority == 0 and chat.turn.sampling.max_tokens == 5
    gen = lines.request_for("/v1/completions", {"prompt": "Once", "max_tokens": 5}, LIMITS)
    assert isinstance(gen, pb.GenerateRequest) and gen.prompt == "Once" and gen.routing.priority == 0
    assert chat.turn.routing.background and gen.routing.background  # the workers' background class


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "x", "stream": True}, "'stream' must be false in a batch"),
        ({"prompt": "x", "max_tokens": 65}, "max_tokens"),
        ({"prompt": "x", "logprobs": True}, "'logprobs' must be an integer"),
        ({"prompt": ""}, "prompt is empty"),
    ],
)
def test_bad_bodies_are_refused_like_the_http_api(body: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        lines.request_for("/v1/completions", body, LIMITS)


def test_output_and_error_lines_are_openais() -> None:
    ok = json.loads(lines.success("batch_abc", 3, "q3", "rid", {"object": "text_completion"}))
    assert ok == {
        "id": "batch_req_abc_3",
        "custom_id": "q3",
        "response": {"status_code": 200, "request_id": "rid", "body": {"object": "text_completion"}},
        "error": None,
    }
    bad = json.loads(lines.failure("batch_abc", 4, "q4", "rid", "INVALID_ARGUMENT", "prompt is empty"))
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["message"] == "prompt is empty"
    assert bad["error"] == {"code": "invalid_request_error", "message": "prompt is empty"}
