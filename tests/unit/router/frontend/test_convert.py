"""pb <-> domain at the router's service edges: what the gateway's client of a split router sends is
what the router's servicer reads back, and frames come back as the events they carry."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.generation import FinishReason
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import SamplingParams
from services.router.balancer.tiers import TierName
from services.router.frontend import convert
from services.router.tools import Tool, ToolCall, ToolCallDelta, ToolChoice, ToolChoiceMode
from services.router.types import (
    ChatMessage,
    ChatTurn,
    Chunk,
    Done,
    Generation,
    ModelInfo,
    Route,
    Routing,
)


@pytest.mark.parametrize(
    "routing",
    [
        Routing(),
        Routing(hint=TierName.CLOUD, use_cache=False, priority=3),
        Routing(hint=TierName.EDGE, shareable=True),
        Routing(background=True),
    ],
)
def test_requests_survive_the_wire(routing: Routing) -> None:
    sampling = SamplingParams(max_tokens=0, temperature=0.5, top_p=0.9, top_k=4, seed=7, stop=("x",))
    g = Generation("hi", sampling, routing, model="m", tenant="t", request_id="r")
    back = convert.generation(convert.generation_pb(g), tenant="t", request_id="r")
    assert back.routing == g.routing and back.prompt == "hi" and back.model == "m"
    assert back.sampling.max_tokens == 0  # still "the router's default"
    assert back.sampling.canonical() == sampling.canonical()
    t = ChatTurn((ChatMessage("user", "a"), ChatMessage("assistant", "b")), sampling, routing, model="m")
    assert convert.chat_turn(convert.chat_turn_pb(t)).messages == t.messages


def test_bad_parameters_are_refused_at_the_edge() -> None:
    with pytest.raises(InvalidArgument, match="temperature"):
        convert.generation(
            pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=3)), tenant="", request_id=""
        )
    with pytest.raises(InvalidArgument, match="priority"):
        convert.chat_turn(pb.ChatTurn(routing=pb.RoutingOptions(priority=10)))


def test_frames_carry_events() -> None:
    assert convert.event(pb.GenerateResponse(request_id="r", sequence=4, token_ids=[1, 2], text="ab")) == Chunk(
        [1, 2], "ab"
    )
    done = Done(FinishReason.STOP_STRING, 5, 2, Route(TierName.CLOUD, "cloud-a", False, "hint"))
    assert convert.event(pb.ChatResponse(turn=1, final=convert.done_pb(done))) == done
    cached = Done(FinishReason.LENGTH, 5, 2, Route(None, "", True, "cache_hit"))
    assert convert.event(pb.GenerateResponse(final=convert.done_pb(cached))) == cached
    models = [ModelInfo("m", (TierName.CLOUD, TierName.EDGE), 2048), ModelInfo("z", (), 512, state="asleep")]
    assert convert.models(convert.models_pb(models)) == models


def test_tools_and_tool_messages_survive_the_wire() -> None:
    weather = Tool("get_weather", "The weather", {"type": "object", "properties": {"city": {"type": "string"}}})
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    messages = (
        ChatMessage("user", "Weather?", name="ann"),
        ChatMessage("assistant", "", tool_calls=(call,)),
        ChatMessage("tool", "21 C", tool_call_id="call_1"),
    )
    for choice in (
        None,
        ToolChoice(ToolChoiceMode.REQUIRED, parallel=False),
        ToolChoice(ToolChoiceMode.FUNCTION, "get_weather"),
        ToolChoice(ToolChoiceMode.NONE),
    ):
        t = ChatTurn(messages, SamplingParams(max_tokens=0), tools=(weather,), tool_choice=choice)
        back = convert.chat_turn(convert.chat_turn_pb(t))
        assert (back.messages, back.tools, back.tool_choice) == (t.messages, t.tools, t.tool_choice)


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        (
            pb.ChatTurn(tools=[pb.Tool(name="f", parameters_json="{")]),
            r"tools\[0\].function.parameters is not valid JSON",
        ),
        (
            pb.ChatTurn(
                tools=[pb.Tool(name="f")],
                tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_FUNCTION, function_name="g"),
            ),
            "tool_choice names function 'g', which is not among the request's tools",
        ),
        (pb.ChatTurn(tools=[pb.Tool(name=f"f{i}") for i in range(129)]), "tools has 129 entries; send at most 128"),
        (pb.ChatTurn(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED)), "tool_choice is 'required' but"),
        (pb.ChatTurn(tool_choice=pb.ToolChoice(mode=9)), "tool_choice.mode 9 is unknown"),  # type: ignore[arg-type]
        (
            pb.ChatTurn(messages=[pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="x" * 300, name="f")])]),
            r"messages\[0\].tool_calls\[0\].id is longer than 256",
        ),
    ],
)
def test_bad_tools_are_refused_naming_the_field(turn: pb.ChatTurn, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        convert.chat_turn(turn)


def test_frames_carry_tool_call_deltas() -> None:
    frame = pb.ChatResponse(
        turn=0,
        token_ids=[1],
        tool_calls=[pb.ToolCallDelta(index=0, id="call_1", name="f", arguments=""), pb.ToolCallDelta(arguments="{")],
    )
    chunk = convert.event(frame)
    assert isinstance(chunk, Chunk)
    assert list(chunk.tool_calls) == [ToolCallDelta(0, "call_1", "f", ""), ToolCallDelta(0, "", "", "{")]
    assert convert.tool_calls_pb(chunk.tool_calls) == list(frame.tool_calls)
    done = Done(FinishReason.TOOL_CALLS, 5, 2, Route(TierName.EDGE, "e", False, "hint"))
    assert convert.done_pb(done).finish_reason == pb.FINISH_REASON_TOOL_CALLS


def test_a_budget_closed_answer_says_so_across_the_wire() -> None:
    done = Done(FinishReason.STOP, 5, 9, Route(TierName.EDGE, "edge-a", False, "hint"), budget_closed=True)
    final = convert.done_pb(done)
    assert final.usage.budget_closed and final.usage.completion_tokens == 9
    assert convert.event(pb.GenerateResponse(final=final)) == done
    assert not convert.done_pb(Done(FinishReason.STOP, 5, 9, done.route)).usage.budget_closed
