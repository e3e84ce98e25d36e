"""The real router on port 0 with fake workers (edge x2, cloud x1) and a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common import errors
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.tokenizer import Tokenizer
from tests.helpers import RedisServer
from tests.integration.router.harness import LONG_PROMPT, META, TOKEN, Mesh, final, generate, request, tokens

pytestmark = [
    pytest.mark.integration,
]


async def test_short_prompt_goes_to_edge_round_robin(mesh: Mesh, tokenizer: Tokenizer) -> None:
    workers = set()
    bypass = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
    for _ in range(2):
        frames = await generate(mesh, request("Hello there", routing=bypass))
        fin = final(frames)
        assert fin.route.tier == pb.TIER_EDGE and fin.route.reason == "prompt_short" and not fin.route.cache_hit
        assert fin.finish_reason == pb.FINISH_REASON_LENGTH
        assert fin.usage.prompt_tokens == len(tokenizer.encode("Hello there"))
        assert fin.usage.completion_tokens == 4 == len(tokens(frames))
        assert frames[0].request_id == "req-1"
        workers.add(fin.route.worker_id)
    assert workers == {"edge-0", "edge-1"}
    start = mesh.edges[0].starts[0]
    assert list(start.prompt_token_ids) == tokenizer.encode("Hello there")
    assert start.tenant == "acme" and start.request_id == "req-1" and start.sampling.max_tokens == 4
    assert not mesh.cloud.starts


async def test_long_prompt_goes_to_cloud(mesh: Mesh) -> None:
    fin = final(await generate(mesh, request(LONG_PROMPT)))
    assert (fin.route.tier, fin.route.reason, fin.route.worker_id) == (pb.TIER_CLOUD, "prompt_long", "cloud-0")


async def test_hint_overrides_length(mesh: Mesh) -> None:
    fin = final(await generate(mesh, request("hi", routing=pb.RoutingOptions(tier=pb.TIER_CLOUD))))
    assert (fin.route.tier, fin.route.reason) == (pb.TIER_CLOUD, "hint")
    fin = final(await generate(mesh, request(LONG_PROMPT, routing=pb.RoutingOptions(tier=pb.TIER_EDGE))))
    assert (fin.route.tier, fin.route.reason) == (pb.TIER_EDGE, "hint")


async def test_no_healthy_edge_spills_to_cloud(mesh: Mesh) -> None:
    for e in mesh.edges:
        assert e.server is not None
        await e.server.set_serving(False)
    await mesh.router.registry.probe_all()
    fin = final(await generate(mesh, request("hi")))
    assert (fin.route.tier, fin.route.reason) == (pb.TIER_CLOUD, "spill")
    fin = final(await generate(mesh, request("hello", routing=pb.RoutingOptions(tier=pb.TIER_EDGE))))
    assert (fin.route.tier, fin.route.reason) == (pb.TIER_CLOUD, "fallback")
    assert not any(e.starts for e in mesh.edges)


async def test_dead_replica_is_retried_elsewhere_and_marked_down(mesh: Mesh) -> None:
    dead = mesh.edges[0]
    await dead.crash()  # gone without telling anyone
    for i in range(3):
        fin = final(await generate(mesh, request(f"hi {i}")))
        assert fin.route.worker_id == "edge-1"
    replica = next(r for r in mesh.router.registry.replicas if r.address == dead.address)
    assert not replica.healthy


async def test_unavailable_before_first_token_fails_over_to_the_other_tier(mesh: Mesh) -> None:
    mesh.edges[0].fail_next = errors.Unavailable("fake failure")
    mesh.edges[1].fail_next = errors.Unavailable("fake failure")
    fin = final(await generate(mesh, request("hi")))
    assert (fin.route.tier, fin.route.reason) == (pb.TIER_CLOUD, "spill")


async def test_unavailable_everywhere_before_first_token_is_unavailable(mesh: Mesh) -> None:
    mesh.edges[0].fail_next = errors.Unavailable("fake failure")
    mesh.edges[1].fail_next = errors.Unavailable("fake failure")
    mesh.cloud.fail_next = errors.Unavailable("fake failure")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(mesh, request("hi"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "fake failure" not in (err.value.details() or "")  # worker text is not passed on
    await mesh.router.registry.probe_all()
    mesh.edges[0].fail_next = errors.Unavailable("fake failure")
    fin = final(await generate(mesh, request("hi")))
    assert fin.route.tier == pb.TIER_EDGE and fin.finish_reason == pb.FINISH_REASON_LENGTH


async def test_greedy_repeat_is_served_from_cache(mesh: Mesh) -> None:
    first = await generate(mesh, request("What is 2+2?", max_tokens=6))
    second = await generate(mesh, request("What is 2+2?", max_tokens=6))
    assert not final(first).route.cache_hit
    fin = final(second)
    assert fin.route.cache_hit and fin.route.reason == "cache_hit" and fin.route.worker_id == ""
    assert tokens(first) == tokens(second)
    assert "".join(f.text for f in first) == "".join(f.text for f in second)
    assert fin.usage == final(first).usage
    assert sum(len(w.starts) for w in mesh.all()) == 1
    # Another tenant does not see acme's entry; a shareable request is keyed without the salt.
    other = (("x-meshserve-internal-token", TOKEN), ("x-meshserve-tenant", "globex"))
    frames = [r async for r in mesh.stub.Generate(request("What is 2+2?", max_tokens=6), metadata=other)]
    assert not final(frames).route.cache_hit
    # Bypass neither reads nor writes.
    bypass = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
    assert not final(await generate(mesh, request("What is 2+2?", max_tokens=6, routing=bypass))).route.cache_hit


async def test_seeded_sampling_cached_unseeded_not(mesh: Mesh) -> None:
    seeded = request("Tell a story", max_tokens=5, temperature=0.8, seed=7)
    a, b = await generate(mesh, seeded), await generate(mesh, seeded)
    assert not final(a).route.cache_hit and final(b).route.cache_hit and tokens(a) == tokens(b)
    unseeded = request("Tell a story", max_tokens=5, temperature=0.8)
    c, d = await generate(mesh, unseeded), await generate(mesh, unseeded)
    assert not final(c).route.cache_hit and not final(d).route.cache_hit
    assert sum(len(w.starts) for w in mesh.all()) == 3


async def test_client_cancel_reaches_the_worker(mesh: Mesh) -> None:
    for w in mesh.all():
        w.token_delay_s = 0.02
    call = mesh.stub.Generate(request("hi", max_tokens=2000), metadata=META)
    frames = 0
    async for _frame in call:
        frames += 1
        if frames == 2:
            call.cancel()
            break
    serving = next(w for w in mesh.edges if w.starts)
    await asyncio.wait_for(serving.cancelled.wait(), 5)
    assert serving.aborted == 1


async def test_complete_is_one_message(mesh: Mesh) -> None:
    streamed = await generate(
        mesh, request("Complete me", max_tokens=5, routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS))
    )
    resp = await mesh.stub.Complete(request("Complete me", max_tokens=5), metadata=META)
    assert list(resp.token_ids) == tokens(streamed)
    assert resp.text == "".join(f.text for f in streamed)
    assert resp.final.usage.completion_tokens == 5 and resp.final.finish_reason == pb.FINISH_REASON_LENGTH


async def test_chat_two_turns_and_cancel_on_one_stream(mesh: Mesh, tokenizer: Tokenizer) -> None:
    outbox: asyncio.Queue[pb.ChatRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.ChatRequest]:
        while (item := await outbox.get()) is not None:
            yield item

    call = mesh.stub.Chat(requests(), metadata=META)

    async def turn_frames() -> list[pb.ChatResponse]:
        frames = []
        while True:
            frame = await call.read()
            assert frame is not grpc.aio.EOF
            frames.append(frame)
            if frame.HasField("final"):
                return frames

    def turn(text: str, max_tokens: int) -> pb.ChatRequest:
        return pb.ChatRequest(
            turn=pb.ChatTurn(
                messages=[pb.ChatMessage(role="user", content=text)],
                sampling=pb.SamplingParams(max_tokens=max_tokens),
            )
        )

    outbox.put_nowait(turn("Hi, who are you?", 3))
    first = await turn_frames()
    assert {f.turn for f in first} == {0} and [f.sequence for f in first] == list(range(len(first)))
    assert sum(len(f.token_ids) for f in first) == 3 and 2 <= len(first) <= 4  # token frames may be merged
    fin = first[-1].final
    assert fin.finish_reason == pb.FINISH_REASON_LENGTH and fin.route.tier == pb.TIER_EDGE
    worker = next(w for w in mesh.edges if w.starts)
    reply1 = "".join(f.text for f in first)

    worker.token_delay_s = 0.02
    outbox.put_nowait(turn("Tell me a long story", 2000))
    second = [await call.read()]
    outbox.put_nowait(pb.ChatRequest(cancel=pb.Cancel()))
    second += await turn_frames() if not second[0].HasField("final") else []
    assert {f.turn for f in second} == {1}
    assert [f.sequence for f in second] == list(range(len(second)))
    assert second[-1].final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert worker.cancels == 1 and worker.aborted == 0
    reply2 = "".join(f.text for f in second)

    worker.token_delay_s = 0
    outbox.put_nowait(turn("Shorter, please", 2))
    third = await turn_frames()
    assert {f.turn for f in third} == {2} and third[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
    outbox.put_nowait(None)
    assert await call.read() is grpc.aio.EOF
    assert (await call.code()) == grpc.StatusCode.OK

    # One worker stream for the whole chat; each start carries the whole conversation so far.
    assert worker.start_calls == [worker.start_calls[0]] * 3
    conversation = [
        {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": reply1},
        {"role": "user", "content": "Tell me a long story"},
        {"role": "assistant", "content": reply2},
        {"role": "user", "content": "Shorter, please"},
    ]
    assert list(worker.starts[2].prompt_token_ids) == tokenizer.apply_chat_template(conversation)
    assert third[-1].final.usage.prompt_tokens == len(worker.starts[2].prompt_token_ids)


async def test_chat_turns_queued_beyond_the_limit_end_the_stream_and_are_not_read(mesh: Mesh) -> None:
    """The router stops reading a Chat stream that sends more than max_queued_chat_turns (8) turns ahead
    of the one in progress: the turn in progress finishes, then RESOURCE_EXHAUSTED; no queued turn runs."""
    outbox: asyncio.Queue[pb.ChatRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.ChatRequest]:
        while (item := await outbox.get()) is not None:
            yield item

    def turn(n: int, max_tokens: int) -> pb.ChatRequest:
        return pb.ChatRequest(
            turn=pb.ChatTurn(
                messages=[pb.ChatMessage(role="user", content=f"turn {n}")],
                sampling=pb.SamplingParams(max_tokens=max_tokens),
            )
        )

    for w in mesh.all():
        w.token_delay_s = 0.02  # the first turn runs ~0.6 s: the others arrive while it does
    call = mesh.stub.Chat(requests(), metadata=META)
    outbox.put_nowait(turn(0, 30))
    frames = [await call.read()]  # turn 0 is in progress
    for n in range(1, 10):  # 8 queued turns are allowed; the 9th is one too many
        outbox.put_nowait(turn(n, 2))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while (frame := await call.read()) is not grpc.aio.EOF:
            frames.append(frame)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than 8 chat turns" in (err.value.details() or "")
    assert {f.turn for f in frames} == {0} and frames[-1].final.usage.completion_tokens == 30
    assert sum(len(w.starts) for w in mesh.all()) == 1  # none of the queued turns ran


@pytest.mark.parametrize(
    ("req", "code"),
    [
        (request(""), grpc.StatusCode.INVALID_ARGUMENT),
        (request("hi", temperature=3.0), grpc.StatusCode.INVALID_ARGUMENT),
        (request("hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
        (request("hi", max_tokens=8192), grpc.StatusCode.INVALID_ARGUMENT),
        (request("word " * 9000, max_tokens=1), grpc.StatusCode.INVALID_ARGUMENT),
        (request("hi", stop=["s"] * 9), grpc.StatusCode.INVALID_ARGUMENT),
        (request("hi", routing=pb.RoutingOptions(priority=10)), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(model="gpt-9", prompt="hi"), grpc.StatusCode.NOT_FOUND),
    ],
)
async def test_invalid_requests(mesh: Mesh, req: pb.GenerateRequest, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(mesh, req)
    assert err.value.code() == code
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.stub.Complete(req, metadata=META)
    assert err.value.code() == code
    assert not any(w.starts for w in mesh.all())


async def test_invalid_chat_turn(mesh: Mesh) -> None:
    async def requests() -> AsyncIterator[pb.ChatRequest]:
        yield pb.ChatRequest(turn=pb.ChatTurn())

    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [r async for r in mesh.stub.Chat(requests(), metadata=META)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_redis_down_is_a_miss(mesh: Mesh, redis_srv: RedisServer) -> None:
    req = request("Cache me if you can", max_tokens=3)
    redis_srv.stop()
    try:
        a, b = await generate(mesh, req), await generate(mesh, req)
        assert not final(a).route.cache_hit and not final(b).route.cache_hit
        assert mesh.router.cache.stats.errors >= 2
    finally:
        redis_srv.start()
    await generate(mesh, req)
    assert final(await generate(mesh, req)).route.cache_hit  # back without a restart
    assert sum(len(w.starts) for w in mesh.all()) == 3


async def test_missing_internal_token_is_denied(mesh: Mesh) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [r async for r in mesh.stub.Generate(request("hi"))]
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.stub.ListModels(pb.ListModelsRequest(), metadata=(("x-meshserve-internal-token", "wrong"),))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_list_models(mesh: Mesh) -> None:
    resp = await mesh.stub.ListModels(pb.ListModelsRequest(), metadata=META)
    (model,) = resp.models
    assert model.id == "smollm2-135m-instruct" and model.context_length == 8192
    assert set(model.tiers) == {pb.TIER_EDGE, pb.TIER_CLOUD}
