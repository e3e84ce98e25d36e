"""The one place a request's unset sampling fields get its model's generation defaults: RouterAPI's turn,
for Generate and for each chat turn, per version; an explicit field wins; a turn under structured output
or with callable tools gets no default penalty; ListModels shows each model's defaults.

The worker is the scripted stream of test_api.py: what it is sent is what these tests look at."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common.constraints import check_constraint
from services.common.generation import FinishReason, GenerationRequest
from services.common.generation_defaults import GenerationDefaults
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling_pb import from_pb
from services.common.tokenizer import Tokenizer
from services.router.balancer.core import Router
from services.router.balancer.registry import Registry, Replica
from services.router.balancer.tiers import TierName
from services.router.frontend import convert
from services.router.frontend.api import RouterAPI
from services.router.frontend.models import ModelTable
from services.router.tools import Tool, ToolChoice, ToolChoiceMode
from services.router.types import ChatMessage, ChatTurn, Generation, Routing
from services.store.response_cache import ResponseCache
from tests.unit.router.frontend.test_api import FakeTransport, FakeWorkerStream, collect, worker

CONTEXT = 256
DEFAULTS = GenerationDefaults(temperature=0.2, top_p=0.9, repetition_penalty=1.2, max_tokens=11, stop=("\n\n",))


@pytest.fixture
async def api(tokenizer: Tokenizer) -> AsyncIterator[RouterAPI]:
    FakeWorkerStream.opened = []
    cache = ResponseCache.from_url("")
    registry = Registry([], [], internal_token="t", block_tokens=16, model_version="v1")
    registry.replicas.append(Replica("edge:1", TierName.EDGE, None, None, healthy=True, worker_id="e"))  # type: ignore[arg-type]
    router = Router(
        tokenizer=tokenizer,
        cache=cache,
        registry=registry,
        model_id="m",
        model_version="v1",
        internal_token="t",
        edge_max_prompt_tokens=CONTEXT,
        transport=FakeTransport(),
    )
    table = ModelTable.single(router, CONTEXT, DEFAULTS)
    yield RouterAPI(router, context_length=CONTEXT, default_max_tokens=7, models=table)
    await router.collapser.aclose()
    await cache.close()


async def sent(api: RouterAPI, sampling: pb.SamplingParams) -> GenerationRequest:
    """What the worker is sent for a Generate whose wire sampling is ``sampling``."""
    request = Generation("Hello there", from_pb(sampling), Routing(use_cache=False))
    task = asyncio.create_task(collect(api.generate(request)))
    stream = await worker()
    await stream.started.wait()
    stream.answer("x", finish=FinishReason.STOP)
    await task
    return stream.starts[0]


async def test_a_generate_that_sets_nothing_gets_the_models_defaults(api: RouterAPI) -> None:
    start = await sent(api, pb.SamplingParams())
    s = start.sampling
    assert (s.temperature, s.top_p, s.repetition_penalty, s.stop, s.max_tokens) == (0.2, 0.9, 1.2, ("\n\n",), 11)
    assert not s.defaulted


async def test_an_explicit_field_always_wins_even_at_the_neutral_value(api: RouterAPI) -> None:
    start = await sent(api, pb.SamplingParams(temperature=0.0, repetition_penalty=1.0, top_p=1.0, max_tokens=3))
    s = start.sampling
    assert (s.temperature, s.top_p, s.repetition_penalty, s.max_tokens) == (0.0, 1.0, 1.0, 3)
    assert s.stop == ("\n\n",)  # the one field it left unset


async def test_structured_output_gets_the_defaults_but_not_the_default_penalty(api: RouterAPI) -> None:
    json_mode = pb.SamplingParams(structured=pb.StructuredOutput(json_object=True))
    s = (await sent(api, json_mode)).sampling
    assert s.repetition_penalty == 1.0 and s.temperature == 0.2
    json_mode.repetition_penalty = 1.3
    FakeWorkerStream.opened = []
    assert (await sent(api, json_mode)).sampling.repetition_penalty == pytest.approx(1.3)


WEATHER = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}})


async def chat_start(api: RouterAPI, **over: Any) -> GenerationRequest:
    chat = api.chat(tenant="acme")
    events = chat.events()
    args: dict[str, Any] = dict(
        messages=(ChatMessage("user", "Weather in Paris?"),), sampling=from_pb(pb.SamplingParams())
    )
    args.update(over)
    assert await chat.send(ChatTurn(**args))
    first = asyncio.create_task(anext(events))
    stream = await worker()
    await stream.started.wait()
    stream.answer("Sunny.", finish=FinishReason.STOP)
    await first
    await chat.end()
    async for _ in events:
        pass
    return stream.starts[0]


async def test_a_chat_turn_gets_the_same_defaults_as_a_generate(api: RouterAPI) -> None:
    s = (await chat_start(api)).sampling
    assert (s.temperature, s.top_p, s.repetition_penalty, s.max_tokens) == (0.2, 0.9, 1.2, 11)


@pytest.mark.parametrize("mode", [ToolChoiceMode.AUTO, ToolChoiceMode.REQUIRED])
async def test_a_turn_whose_tools_may_be_called_gets_no_default_penalty(api: RouterAPI, mode: ToolChoiceMode) -> None:
    s = (await chat_start(api, tools=(WEATHER,), tool_choice=ToolChoice(mode))).sampling
    assert s.structured is not None and s.repetition_penalty == 1.0 and s.temperature == 0.2


async def test_tool_choice_none_is_unconstrained_and_keeps_the_default_penalty(api: RouterAPI) -> None:
    s = (await chat_start(api, tools=(WEATHER,), tool_choice=ToolChoice(ToolChoiceMode.NONE))).sampling
    assert s.structured is None and s.repetition_penalty == 1.2


async def test_list_models_shows_each_models_defaults_and_they_cross_the_wire(api: RouterAPI) -> None:
    (info,) = await api.list_models()
    assert info.generation_defaults == DEFAULTS
    back = convert.models(convert.models_pb([info]))
    assert back[0].generation_defaults == DEFAULTS  # float32 on the wire, rounded back
    empty = convert.models(convert.models_pb([info.__class__("n", (), 8)]))
    assert empty[0].generation_defaults == GenerationDefaults()


def test_the_constraint_in_a_regex_request_is_kept_when_defaults_apply() -> None:
    regex = from_pb(pb.SamplingParams(structured=pb.StructuredOutput(regex="[0-9]+")))
    applied = DEFAULTS.apply(regex)
    assert applied.structured == check_constraint("regex", "[0-9]+") and applied.repetition_penalty == 1.0
