"""Penalties, ``logit_bias`` and ``min_tokens`` on the real model, through the public gRPC API on both tiers
and through the official ``openai`` client via Envoy; replies that name the served model. (The default
model's generation defaults, which end its loops, are checked where its models file serves them:
tests/e2e/test_structured_guarantees.py.)"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import grpc
import openai
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.controlplane.frontdoor import FrontDoor
from tests.e2e.conftest import API_KEY, auth

pytestmark = pytest.mark.e2e
PROMPT = "The sea is"
TIERS = [pb.TIER_EDGE, pb.TIER_CLOUD]


def request(tier: int, max_tokens: int = 16, prompt: str = PROMPT, **kw: object) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    routing = pb.RoutingOptions(tier=tier, cache_policy=pb.CACHE_POLICY_BYPASS)  # type: ignore[arg-type]
    return pb.GenerateRequest(prompt=prompt, sampling=sampling, routing=routing)


async def both_ways(gateway, req: pb.GenerateRequest) -> tuple[list[int], str, pb.Final]:  # type: ignore[no-untyped-def]
    """Complete and streamed Generate of one request: they must agree (greedy); returns Complete's."""
    reply = await gateway.Complete(req, metadata=auth())
    ids: list[int] = []
    text = ""
    async for frame in gateway.Generate(req, metadata=auth()):
        ids.extend(frame.token_ids)
        text += frame.text
    assert text == reply.text
    assert ids == list(reply.token_ids)
    assert reply.final.route.tier == req.routing.tier
    return list(reply.token_ids), reply.text, reply.final


@pytest.mark.parametrize("tier", TIERS)
async def test_each_penalty_changes_the_greedy_answer_as_it_should(gateway, tier: int) -> None:  # type: ignore[no-untyped-def]
    base, _, _ = await both_ways(gateway, request(tier))
    assert len(base) == 16
    # logit_bias -100 bans the first token; +100 forces a token at every step
    banned, _, _ = await both_ways(gateway, request(tier, 4, logit_bias={base[0]: -100}))
    assert banned[0] != base[0]
    forced, _, _ = await both_ways(gateway, request(tier, 4, logit_bias={base[1]: 100}))
    assert forced == [base[1]] * 4
    # repetition over the prompt and the output; frequency and presence over the output
    for field, value in (("repetition_penalty", 1.5), ("frequency_penalty", 1.5), ("presence_penalty", 2.0)):
        ids, _, _ = await both_ways(gateway, request(tier, **{field: value}))
        assert ids != base, field
        assert max(Counter(ids).values()) <= max(Counter(base).values()), field
        again, _, _ = await both_ways(gateway, request(tier, **{field: value}))
        assert again == ids, f"greedy with {field} is deterministic"


@pytest.mark.parametrize("tier", TIERS)
async def test_min_tokens_holds_off_eos_and_stop_strings(gateway, tier: int) -> None:  # type: ignore[no-untyped-def]
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    _, text, final = await both_ways(gateway, request(tier, 40, prompt))
    assert final.finish_reason == pb.FINISH_REASON_STOP and final.usage.completion_tokens < 12
    _, _, longer = await both_ways(gateway, request(tier, 40, prompt, min_tokens=20))
    assert longer.usage.completion_tokens >= 20
    word = text.split()[1]  # a stop string the answer reaches within its first tokens
    _, _, stopped = await both_ways(gateway, request(tier, 40, prompt, stop=[word]))
    assert stopped.finish_reason == pb.FINISH_REASON_STOP_STRING
    _, kept, held = await both_ways(gateway, request(tier, 40, prompt, stop=[word], min_tokens=20))
    assert word in kept and held.usage.completion_tokens >= 20


async def test_penalties_are_part_of_the_response_cache_key(gateway) -> None:  # type: ignore[no-untyped-def]
    cached = pb.RoutingOptions(tier=pb.TIER_EDGE)
    plain = pb.GenerateRequest(prompt="A haiku about rain:", sampling=pb.SamplingParams(max_tokens=12), routing=cached)
    first = await gateway.Complete(plain, metadata=auth())
    assert (await gateway.Complete(plain, metadata=auth())).final.route.cache_hit
    penalised = pb.GenerateRequest()
    penalised.CopyFrom(plain)
    penalised.sampling.frequency_penalty = 2.0
    reply = await gateway.Complete(penalised, metadata=auth())
    assert not reply.final.route.cache_hit and reply.text != first.text
    assert (await gateway.Complete(penalised, metadata=auth())).final.route.cache_hit


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [
        (pb.SamplingParams(frequency_penalty=2.5), "sampling.frequency_penalty must be between -2 and 2"),
        (pb.SamplingParams(presence_penalty=-3), "sampling.presence_penalty must be between -2 and 2"),
        (pb.SamplingParams(repetition_penalty=0), "sampling.repetition_penalty must be above 0"),
        (pb.SamplingParams(logit_bias={5: 101}), "sampling.logit_bias for token 5"),
        (pb.SamplingParams(logit_bias={i: 1 for i in range(301)}), "send at most 300"),
        (pb.SamplingParams(logit_bias={49152: 1}), "outside the model's vocabulary of 49152"),
        (pb.SamplingParams(min_tokens=9, max_tokens=8), "sampling.min_tokens"),
    ],
)
async def test_bad_values_are_invalid_argument_naming_the_field(gateway, sampling, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await gateway.Complete(pb.GenerateRequest(prompt=PROMPT, sampling=sampling), metadata=auth())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (info.value.details() or "")


# -- the official openai client through Envoy ------------------------------------------------------------


@pytest.fixture
async def client(door: FrontDoor) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


CHAT = [
    {"role": "user", "content": "Tell me about the sea"}
]  # greedy, it repeats its sentences: each penalty changes that
FIELDS: list[dict[str, object]] = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"extra_body": {"repetition_penalty": 1.5}},
    {"logit_bias": {"504": 100}},  # forced at every step
]


async def _openai_chat(client: openai.AsyncOpenAI, **kw: object) -> tuple[str, str, int]:
    """Non-streamed and streamed: the same text; returns (text, model, completion tokens)."""
    reply = await client.chat.completions.create(model="", messages=CHAT, max_tokens=32, temperature=0, **kw)  # type: ignore[call-overload]
    text = reply.choices[0].message.content or ""
    stream = await client.chat.completions.create(
        model="", messages=CHAT, max_tokens=32, temperature=0, stream=True, **kw
    )  # type: ignore[call-overload]
    deltas = []
    async for chunk in stream:
        assert chunk.model == reply.model
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
    assert "".join(deltas) == text
    assert reply.usage is not None
    return text, reply.model, reply.usage.completion_tokens


async def _openai_completion(client: openai.AsyncOpenAI, **kw: object) -> tuple[str, str]:
    reply = await client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0, **kw)  # type: ignore[call-overload]
    stream = await client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0, stream=True, **kw)  # type: ignore[call-overload]
    texts = []
    async for chunk in stream:
        assert chunk.model == reply.model
        texts.append(chunk.choices[0].text)
    assert "".join(texts) == reply.choices[0].text
    return reply.choices[0].text, reply.model


async def test_every_field_through_the_openai_client(client: openai.AsyncOpenAI) -> None:
    (served,) = [m.id async for m in client.models.list()]
    chat_base, model, _ = await _openai_chat(client)
    completion_base, completion_model = await _openai_completion(client)
    assert model == completion_model == served  # not the request's ""
    for kw in FIELDS:
        chat, _, tokens = await _openai_chat(client, **kw)
        assert chat != chat_base, kw
        completion, _ = await _openai_completion(client, **kw)
        assert completion != completion_base, kw
    forced, _, tokens = await _openai_chat(client, logit_bias={"504": 100})
    assert tokens == 32 and len(set(forced.split())) <= 2  # one token, repeated
    # min_tokens: a stop string the answer reaches early is ignored until 14 tokens are out
    word = chat_base.split()[1]  # reached within the answer's first tokens
    _, _, stopped = await _openai_chat(client, stop=[word])
    _, _, held = await _openai_chat(client, stop=[word], extra_body={"min_tokens": 14})
    assert stopped < 14 <= held


async def test_bad_values_are_400_naming_the_field(client: openai.AsyncOpenAI) -> None:
    for kw, needle in (
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_tokens": 40}}, "min_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="", messages=CHAT, max_tokens=16, **kw)  # type: ignore[call-overload]
        assert needle in str(info.value), kw
