"""pb <-> domain at the router's service edges: what the gateway's client of a split router sends is
what the router's servicer reads back, and frames come back as the events they carry."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import SamplingParams
from services.router import convert
from services.router.policy import TierName
from services.router.types import (
    ChatMessage,
    ChatTurn,
    Chunk,
    Done,
    FinishReason,
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
    models = [ModelInfo("m", (TierName.CLOUD, TierName.EDGE), 2048)]
    assert convert.models(convert.models_pb(models)) == models
