"""Request validation: every rule rejects with one sentence; good requests pass."""

from __future__ import annotations

import math

import pytest

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.validation import Limits, validate_chat_request, validate_generate

LIMITS = Limits(max_prompt_chars=100, max_tokens=50, max_stop_strings=2, max_stop_chars=5, max_chat_messages=3)


def gen(prompt: str = "hi", **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(**sampling))  # type: ignore[arg-type]


def chat(*messages: tuple[str, str], **sampling: object) -> pb.ChatRequest:
    turn = pb.ChatTurn(
        messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
        sampling=pb.SamplingParams(**sampling),  # type: ignore[arg-type]
    )
    return pb.ChatRequest(turn=turn)


@pytest.mark.parametrize(
    "request_",
    [
        gen(),
        gen("x" * 100, max_tokens=50, temperature=2.0, top_p=1.0, stop=["ab", "cdefg"]),
        gen(temperature=0.0, top_p=0.0),
        pb.GenerateRequest(prompt="hi", routing=pb.RoutingOptions(tier=pb.TIER_CLOUD, priority=9)),
    ],
)
def test_valid_generate_passes(request_: pb.GenerateRequest) -> None:
    validate_generate(request_, LIMITS)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (gen(""), "prompt"),
        (gen(" \t\n"), "prompt"),
        (gen("x" * 101), "prompt"),
        (gen(max_tokens=51), "max_tokens"),
        (gen(temperature=2.01), "temperature"),
        (gen(temperature=-1), "temperature"),
        (gen(temperature=math.nan), "temperature"),
        (gen(top_p=1.01), "top_p"),
        (gen(top_p=-0.5), "top_p"),
        (gen(stop=["a", "b", "c"]), "stop"),
        (gen(stop=[""]), "stop"),
        (gen(stop=["toolong"]), "stop"),
        (pb.GenerateRequest(prompt="hi", routing=pb.RoutingOptions(priority=10)), "priority"),
        (pb.GenerateRequest(prompt="hi", routing=pb.RoutingOptions(tier=99)), "tier"),  # type: ignore[arg-type]
        (pb.GenerateRequest(prompt="hi", model="m" * 200), "model"),
    ],
)
def test_invalid_generate_names_the_field_in_one_sentence(request_: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_generate(request_, LIMITS)
    assert field in err.value.message and "\n" not in err.value.message


def test_valid_chat_frames_pass() -> None:
    validate_chat_request(chat(("system", "be nice"), ("user", "hi"), ("assistant", "")), LIMITS)
    validate_chat_request(pb.ChatRequest(cancel=pb.Cancel()), LIMITS)


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (pb.ChatRequest(), "neither a turn nor a cancel"),
        (pb.ChatRequest(turn=pb.ChatTurn()), "no messages"),
        (chat(("user", "a"), ("user", "b"), ("user", "c"), ("user", "d")), "at most 3"),
        (chat(("robot", "hi")), "role"),
        (chat(("user", "   ")), "empty"),
        (chat(("user", "x" * 60), ("assistant", "y" * 60)), "limit of 100"),
        (chat(("user", "hi"), max_tokens=51), "max_tokens"),
        (chat(("user", "hi"), top_p=2), "top_p"),
    ],
)
def test_invalid_chat_frames(request_: pb.ChatRequest, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        validate_chat_request(request_, LIMITS)


def _turn(*messages: pb.ChatMessage) -> pb.ChatRequest:
    return pb.ChatRequest(turn=pb.ChatTurn(messages=messages))


CALL = pb.ToolCall(id="call_1", name="f", arguments="{}")


def test_tool_messages_and_calls_pass() -> None:
    validate_chat_request(
        _turn(
            pb.ChatMessage(role="assistant", tool_calls=[CALL]),
            pb.ChatMessage(role="tool", tool_call_id="call_1", content="42"),
        ),
        LIMITS,
    )


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (_turn(pb.ChatMessage(role="tool", content="42")), r"messages\[0\] is a tool message without tool_call_id"),
        (_turn(pb.ChatMessage(role="user", content="hi", tool_calls=[CALL])), "has tool_calls but is not an assistant"),
        (_turn(pb.ChatMessage(role="tool", content="4", tool_call_id="x" * 257)), "longer than 256"),
        (_turn(pb.ChatMessage(role="user", content="hi", name="n" * 65)), r"messages\[0\].name is longer than 64"),
        (_turn(pb.ChatMessage(role="assistant", tool_calls=[CALL] * 129)), "send at most 128"),
        (_turn(pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(arguments="x" * 101)])), "limit of 100"),
    ],
)
def test_invalid_tool_messages(request_: pb.ChatRequest, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        validate_chat_request(request_, LIMITS)
