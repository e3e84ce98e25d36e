"""Structured output on the real model: regex, Lark grammar and JSON schema constraints through the public
gRPC API on both tiers, and ``response_format`` (json_object, json_schema) through the official ``openai``
client via Envoy, streaming and not; bad constraints are a 400 / INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import grpc
import jsonschema
import openai
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.controlplane.frontdoor import FrontDoor
from tests.e2e.conftest import API_KEY, auth

pytestmark = pytest.mark.e2e
TIERS = [pb.TIER_EDGE, pb.TIER_CLOUD]
MOON = "<|im_start|>user\nWhen did the first person land on the moon?<|im_end|>\n<|im_start|>assistant\n"
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def request(tier: int, structured: pb.StructuredOutput, prompt: str = MOON, max_tokens: int = 24) -> pb.GenerateRequest:
    routing = pb.RoutingOptions(tier=tier, cache_policy=pb.CACHE_POLICY_BYPASS)  # type: ignore[arg-type]
    sampling = pb.SamplingParams(max_tokens=max_tokens, structured=structured)
    return pb.GenerateRequest(prompt=prompt, sampling=sampling, routing=routing)


async def both_ways(gateway, req: pb.GenerateRequest) -> pb.GenerateResponse:  # type: ignore[no-untyped-def]
    reply = await gateway.Complete(req, metadata=auth())
    text = "".join([frame.text async for frame in gateway.Generate(req, metadata=auth())])
    assert text == reply.text
    assert reply.final.route.tier == req.routing.tier
    return reply


@pytest.mark.parametrize("tier", TIERS)
async def test_regex_and_grammar_constraints_hold_on_both_tiers(gateway, tier: int) -> None:  # type: ignore[no-untyped-def]
    reply = await both_ways(gateway, request(tier, pb.StructuredOutput(regex=DATE)))
    assert re.fullmatch(DATE, reply.text), reply.text
    assert reply.final.finish_reason == pb.FINISH_REASON_STOP
    grammar = 'start: answer "." \nanswer: "yes" | "no" | "in " YEAR\nYEAR: /[0-9]{4}/'
    reply = await both_ways(gateway, request(tier, pb.StructuredOutput(grammar=grammar)))
    assert re.fullmatch(r"(yes|no|in [0-9]{4})\.", reply.text), reply.text


async def test_a_json_schema_over_grpc_parses_and_validates(gateway) -> None:  # type: ignore[no-untyped-def]
    prompt = "<|im_start|>user\nGive me a city as JSON.<|im_end|>\n<|im_start|>assistant\n"
    reply = await both_ways(
        gateway, request(pb.TIER_CLOUD, pb.StructuredOutput(json_schema=json.dumps(CITY)), prompt, 40)
    )
    jsonschema.validate(json.loads(reply.text), CITY)


async def test_the_constraint_is_part_of_the_response_cache_key(gateway) -> None:  # type: ignore[no-untyped-def]
    cached = pb.RoutingOptions(tier=pb.TIER_EDGE)
    plain = pb.GenerateRequest(prompt=MOON, sampling=pb.SamplingParams(max_tokens=16), routing=cached)
    await gateway.Complete(plain, metadata=auth())
    assert (await gateway.Complete(plain, metadata=auth())).final.route.cache_hit
    constrained = pb.GenerateRequest()
    constrained.CopyFrom(plain)
    constrained.sampling.structured.regex = DATE
    reply = await gateway.Complete(constrained, metadata=auth())
    assert not reply.final.route.cache_hit and re.fullmatch(DATE, reply.text)
    assert (await gateway.Complete(constrained, metadata=auth())).final.route.cache_hit


@pytest.mark.parametrize(
    ("structured", "needle"),
    [
        (pb.StructuredOutput(json_schema="{"), "sampling.structured: the json_schema is not valid JSON"),
        (pb.StructuredOutput(regex="a" * 40000), "above the limit of 32768"),
        (pb.StructuredOutput(json_schema='{"type": "nope"}'), "response_format (sampling.structured): the json_schema"),
        (pb.StructuredOutput(regex="(("), "the regex is not valid"),
    ],
)
async def test_bad_constraints_are_invalid_argument_naming_the_field(gateway, structured, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await gateway.Complete(request(pb.TIER_EDGE, structured), metadata=auth())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (info.value.details() or "")


# -- the official openai client through Envoy ------------------------------------------------------------


@pytest.fixture
async def client(door: FrontDoor) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


CITY_CHAT = [{"role": "user", "content": "Give me a city and its population as JSON."}]
STRICT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}


async def _both(client: openai.AsyncOpenAI, **kw: object) -> str:
    """Non-streamed and streamed chat: the same text, finished by the grammar (not cut by max_tokens)."""
    reply = await client.chat.completions.create(model="", messages=CITY_CHAT, max_tokens=48, temperature=0, **kw)  # type: ignore[call-overload]
    text = reply.choices[0].message.content or ""
    assert reply.choices[0].finish_reason == "stop", text
    stream = await client.chat.completions.create(
        model="", messages=CITY_CHAT, max_tokens=48, temperature=0, stream=True, **kw
    )  # type: ignore[call-overload]
    deltas = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(deltas) == text
    return text


async def test_response_format_json_object_and_json_schema(client: openai.AsyncOpenAI) -> None:
    assert isinstance(json.loads(await _both(client, response_format={"type": "json_object"})), dict)
    jsonschema.validate(json.loads(await _both(client, response_format=STRICT)), CITY)
    completion = await client.completions.create(
        model="",
        prompt="<|im_start|>user\nGive me a city as JSON.<|im_end|>\n<|im_start|>assistant\n",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": STRICT},
    )
    assert completion.choices[0].finish_reason == "stop", completion.choices[0].text
    jsonschema.validate(json.loads(completion.choices[0].text), CITY)


@pytest.mark.parametrize(
    ("response_format", "needle"),
    [
        ({"type": "xml"}, "'response_format' type 'xml' is not supported"),
        ({"type": "json_schema"}, "'response_format.json_schema' must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "must be a JSON object"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "response_format"),
    ],
)
async def test_a_bad_response_format_is_a_400_naming_it(
    client: openai.AsyncOpenAI, response_format: dict[str, object], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="", messages=CITY_CHAT, max_tokens=8, response_format=response_format
        )  # type: ignore[arg-type]
    assert needle in info.value.message
