"""``n`` choices on the real model: through the public gRPC API on both tiers (the split layout, so the
gateway's remote router counts the finals) and through the official ``openai`` client via Envoy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import openai
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from tests.e2e.conftest import auth
from tests.e2e.test_penalties import client

__all__ = ["client"]
pytestmark = pytest.mark.e2e
PROMPT = "The sea is"
TIERS = [pb.TIER_EDGE, pb.TIER_CLOUD]


def request(tier: int, max_tokens: int = 8, **kw: object) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    routing = pb.RoutingOptions(tier=tier, cache_policy=pb.CACHE_POLICY_BYPASS)  # type: ignore[arg-type]
    return pb.GenerateRequest(prompt=PROMPT, sampling=sampling, routing=routing)


async def choices(gateway, req: pb.GenerateRequest, n: int) -> tuple[list[list[int]], list[pb.Final]]:  # type: ignore[no-untyped-def]
    """Each choice's tokens and final, checking the documented order guarantees on the way."""
    ids: list[list[int]] = [[] for _ in range(n)]
    finals: list[pb.Final | None] = [None] * n
    sequence = 0
    async for frame in gateway.Generate(req, metadata=auth()):
        assert frame.sequence == sequence  # every frame of the stream numbered, no gap
        sequence += 1
        assert finals[frame.index] is None  # nothing of a choice after its final
        ids[frame.index].extend(frame.token_ids)
        if frame.HasField("final"):
            finals[frame.index] = frame.final
    assert all(f is not None for f in finals)  # the stream ended after the n-th final
    return ids, [f for f in finals if f is not None]


@pytest.mark.parametrize("tier", TIERS)
async def test_greedy_choices_equal_the_single_answer_token_for_token(gateway, tier: int) -> None:  # type: ignore[no-untyped-def]
    single = await gateway.Complete(request(tier), metadata=auth())
    ids, finals = await choices(gateway, request(tier, n=3), 3)
    assert ids == [list(single.token_ids)] * 3
    assert {f.usage.prompt_tokens for f in finals} == {single.final.usage.prompt_tokens}
    assert [f.usage.completion_tokens for f in finals] == [single.final.usage.completion_tokens] * 3
    assert {f.route.tier for f in finals} == {tier}


async def test_seeded_choices_are_deterministic_and_differ(gateway) -> None:  # type: ignore[no-untyped-def]
    seeded = request(pb.TIER_EDGE, temperature=1.0, seed=42, n=3)
    first, _ = await choices(gateway, seeded, 3)
    again, _ = await choices(gateway, seeded, 3)
    assert first == again and len({tuple(c) for c in first}) > 1
    alone = await gateway.Complete(request(pb.TIER_EDGE, temperature=1.0, seed=43), metadata=auth())
    assert first[1] == list(alone.token_ids)  # choice i samples with seed + i


async def test_a_chat_turn_of_two_choices_then_a_turn_that_follows_choice_0(gateway) -> None:  # type: ignore[no-untyped-def]
    turn = pb.ChatTurn(
        messages=[pb.ChatMessage(role="user", content="Name a colour.")],
        sampling=pb.SamplingParams(max_tokens=6, n=2),
        routing=pb.RoutingOptions(tier=pb.TIER_EDGE, cache_policy=pb.CACHE_POLICY_BYPASS),
    )
    follow = pb.ChatTurn(
        messages=[pb.ChatMessage(role="user", content="Another?")], sampling=pb.SamplingParams(max_tokens=4)
    )

    async def frames() -> AsyncIterator[pb.ChatRequest]:
        yield pb.ChatRequest(turn=turn)
        yield pb.ChatRequest(turn=follow)

    finals: dict[int, list[int]] = {0: [], 1: []}
    sequences: dict[int, list[int]] = {0: [], 1: []}
    async for frame in gateway.Chat(frames(), metadata=auth()):
        sequences[frame.turn].append(frame.sequence)
        if frame.HasField("final"):
            finals[frame.turn].append(frame.index)
            if frame.turn == 1:
                break
    assert sorted(finals[0]) == [0, 1] and finals[1] == [0]
    assert sequences[1][0] == 0 and sequences[0] == list(range(len(sequences[0])))


@pytest.mark.parametrize(
    ("call", "sampling", "needle"),
    [
        ("Generate", pb.SamplingParams(n=17), "sampling.n must be between 1 and 16"),
        ("Generate", pb.SamplingParams(n=0), "sampling.n must be between 1 and 16"),
        ("Complete", pb.SamplingParams(n=2), "use Generate for n > 1"),
    ],
)
async def test_bad_n_is_invalid_argument_naming_the_field(gateway, call: str, sampling, needle: str) -> None:  # type: ignore[no-untyped-def]
    req = pb.GenerateRequest(prompt=PROMPT, sampling=sampling)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if call == "Complete":
            await gateway.Complete(req, metadata=auth())
        else:
            async for _ in gateway.Generate(req, metadata=auth()):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (info.value.details() or "")


# -- the official openai client through Envoy ------------------------------------------------------------

CHAT = [{"role": "user", "content": "Name three colours."}]


async def test_chat_n_3_streamed_and_not_through_the_openai_client(client: openai.AsyncOpenAI) -> None:
    one = await client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    reply = await client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0, n=3)  # type: ignore[arg-type]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.message.content for c in reply.choices} == {one.choices[0].message.content}  # greedy: equal
    assert one.usage is not None and reply.usage is not None
    assert reply.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert reply.usage.completion_tokens == 3 * one.usage.completion_tokens  # the choices' summed
    stream = await client.chat.completions.create(
        model="",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", "", ""]
    finished: list[int] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.append(choice.index)
    assert texts == [c.message.content for c in reply.choices]
    assert sorted(finished) == [0, 1, 2]
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens


async def test_completions_n_3_streamed_and_not_through_the_openai_client(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model="", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) > 1  # seed + i: the choices differ
    assert reply.usage is not None and reply.usage.completion_tokens <= 24
    stream = await client.completions.create(
        model="", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3, stream=True
    )
    texts = ["", "", ""]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in reply.choices]  # seeded: the same choices again


async def test_n_out_of_range_is_400_naming_the_field_and_limit(client: openai.AsyncOpenAI) -> None:
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="", messages=CHAT, max_tokens=4, n=n)  # type: ignore[arg-type]
        assert "'n' must be between 1 and 16" in str(info.value)
