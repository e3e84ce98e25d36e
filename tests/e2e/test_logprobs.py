"""Logprobs on the real model: the public gRPC API on both tiers (frames carry one entry per token, with
its text and bytes; asking changes no token; never answered from a cache entry without them) and the
official ``openai`` client through Envoy (chat and completions, streaming and not, OpenAI's shapes and
bounds)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc
import openai
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.controlplane.frontdoor import FrontDoor
from tests.e2e.conftest import API_KEY, auth

pytestmark = pytest.mark.e2e
PROMPT = "The capital of France is"
TIERS = [pb.TIER_EDGE, pb.TIER_CLOUD]


def request(tier: int, cache: int = pb.CACHE_POLICY_BYPASS, **kw: object) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=8, **kw)  # type: ignore[arg-type]
    routing = pb.RoutingOptions(tier=tier, cache_policy=cache)  # type: ignore[arg-type]
    return pb.GenerateRequest(prompt=PROMPT, sampling=sampling, routing=routing)


def check_entries(ids: list[int], text: str, entries: list[pb.TokenLogprob], top: int) -> None:
    assert [e.token_id for e in entries] == ids
    assert b"".join(e.token_bytes for e in entries).decode() == text
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == top
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        if top:  # greedy: the chosen token is the most likely one
            assert e.top_logprobs[0].token_id == e.token_id and math.isclose(values[0], e.logprob, abs_tol=1e-6)


@pytest.mark.parametrize("tier", TIERS)
async def test_grpc_frames_carry_logprobs_on_both_tiers(gateway, tier: int) -> None:  # type: ignore[no-untyped-def]
    plain = await gateway.Complete(request(tier), metadata=auth())
    assert not plain.logprobs
    reply = await gateway.Complete(request(tier, logprobs=True, top_logprobs=3), metadata=auth())
    assert reply.final.route.tier == tier
    assert list(reply.token_ids) == list(plain.token_ids) and reply.text == plain.text  # asking changes nothing
    check_entries(list(reply.token_ids), reply.text, list(reply.logprobs), 3)
    streamed: list[pb.TokenLogprob] = []
    async for frame in gateway.Generate(request(tier, logprobs=True, top_logprobs=3), metadata=auth()):
        assert len(frame.logprobs) == len(frame.token_ids)
        streamed.extend(frame.logprobs)
    assert [e.token_id for e in streamed] == list(reply.token_ids)
    for a, b in zip(streamed, reply.logprobs, strict=True):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)


async def test_a_request_with_logprobs_is_never_answered_from_a_cache_entry_without_them(gateway) -> None:  # type: ignore[no-untyped-def]
    plain = request(pb.TIER_EDGE, pb.CACHE_POLICY_USE)
    plain.prompt = "Logprobs and the cache:"
    await gateway.Complete(plain, metadata=auth())
    assert (await gateway.Complete(plain, metadata=auth())).final.route.cache_hit
    asking = pb.GenerateRequest()
    asking.CopyFrom(plain)
    asking.sampling.logprobs = True
    for _ in range(2):  # nor stored: the second is computed again
        reply = await gateway.Complete(asking, metadata=auth())
        assert not reply.final.route.cache_hit and len(reply.logprobs) == len(reply.token_ids) > 0


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [
        (pb.SamplingParams(logprobs=True, top_logprobs=21), "sampling.top_logprobs must be between 0 and 20"),
        (pb.SamplingParams(top_logprobs=2), "sampling.top_logprobs needs sampling.logprobs"),
    ],
)
async def test_grpc_bounds_are_invalid_argument_naming_the_field(gateway, sampling, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await gateway.Complete(pb.GenerateRequest(prompt=PROMPT, sampling=sampling), metadata=auth())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (info.value.details() or "")


# -- the official openai client through Envoy ------------------------------------------------------------


@pytest.fixture
async def client(door: FrontDoor) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


CHAT = [{"role": "user", "content": "Name three colours."}]


async def test_chat_logprobs_streaming_and_not(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )  # type: ignore[call-overload]
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert "".join(c.token for c in content) == choice.message.content
    assert bytes(b for c in content for b in (c.bytes or [])).decode() == choice.message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert reply.usage is not None and len(content) == reply.usage.completion_tokens
    stream = await client.chat.completions.create(
        model="", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )  # type: ignore[call-overload]
    streamed = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content or [])
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [round(c.logprob, 4) for c in streamed] == [round(c.logprob, 4) for c in content]
    plain = await client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0)  # type: ignore[call-overload]
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


async def test_completion_logprobs_streaming_and_not(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model="", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)  # type: ignore[call-overload]
    choice = reply.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
    stream = await client.completions.create(
        model="", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True
    )  # type: ignore[call-overload]
    tokens: list[str] = []
    offsets: list[int] = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens.extend(chunk.choices[0].logprobs.tokens or [])
            offsets.extend(chunk.choices[0].logprobs.text_offset or [])
    assert tokens == lp.tokens and offsets == lp.text_offset


async def test_bounds_are_400_naming_the_field(client: openai.AsyncOpenAI) -> None:
    for kw, needle in (
        ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be between 0 and 20"),
        ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs'"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="", messages=CHAT, max_tokens=4, **kw)  # type: ignore[call-overload]
        assert needle in str(info.value), kw
    with pytest.raises(openai.BadRequestError, match="'logprobs' must be between 0 and 5"):
        await client.completions.create(model="", prompt=PROMPT, max_tokens=4, logprobs=6)  # type: ignore[call-overload]
