"""The real router on port 0 with fake workers (edge x2, cloud x1) and a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import RunningServer
from services.common.settings import load_settings
from services.common.tokenizer import Tokenizer
from services.models.paths import model_paths
from services.router.config import RouterSettings
from services.router.core import Router
from services.router.policy import TierName
from services.router.registry import Registry
from services.router.server import start_router
from tests.helpers import RedisServer
from tests.integration.router.fake_worker import FakeWorker, start_fake

HF_DIR = model_paths().hf_dir
TOKEN = "router-test-token"
META = (("x-meshserve-internal-token", TOKEN), ("x-request-id", "req-1"), ("x-meshserve-tenant", "acme"))
LONG_PROMPT = "Tell me everything about the history of the Roman empire. " * 20

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not (HF_DIR / "tokenizer.json").is_file(), reason="model not prepared"),
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(HF_DIR)


@dataclass
class Mesh:
    router: Router
    server: RunningServer
    edges: list[FakeWorker]
    cloud: FakeWorker
    stub: inference_pb2_grpc.InferenceStub
    channel: grpc.aio.Channel

    def all(self) -> list[FakeWorker]:
        return [*self.edges, self.cloud]


async def wait_serving(channel: grpc.aio.Channel) -> None:
    """Block until the server's health says SERVING (streamed, no polling)."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    async for resp in stream:
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            stream.cancel()
            return


@pytest.fixture
async def mesh(tokenizer: Tokenizer, redis_url: str) -> AsyncIterator[Mesh]:
    edges = [await start_fake(f"edge-{i}", pb.TIER_EDGE, TOKEN) for i in range(2)]
    cloud = await start_fake("cloud-0", pb.TIER_CLOUD, TOKEN)
    settings = load_settings(
        RouterSettings,
        edge_workers=",".join(e.address for e in edges),
        cloud_workers=cloud.address,
        redis_url=redis_url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        cache_retry_after_s=0,
        health_interval_s=0.2,
        eject_base_s=0.001,  # probes may re-admit a failed fake at once
        readmit_s=0,
        stall_timeout_s=1.0,
    )
    server, router = await start_router(settings, tokenizer=tokenizer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    await asyncio.wait_for(wait_serving(channel), 10)
    yield Mesh(router, server, edges, cloud, inference_pb2_grpc.InferenceStub(channel), channel)
    await channel.close()
    await server.stop()
    for w in [*edges, cloud]:
        assert w.server is not None
        await w.server.stop()


def request(prompt: str = "Hello there", max_tokens: int = 4, **kw: object) -> pb.GenerateRequest:
    routing = kw.pop("routing", None)
    return pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, **kw),  # type: ignore[arg-type]
        routing=routing,  # type: ignore[arg-type]
    )


async def generate(mesh: Mesh, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [r async for r in mesh.stub.Generate(req, metadata=META)]


def tokens(frames: list[pb.GenerateResponse]) -> list[int]:
    return [t for f in frames for t in f.token_ids]


def final(frames: list[pb.GenerateResponse]) -> pb.Final:
    assert frames[-1].HasField("final")
    assert [f.sequence for f in frames] == list(range(len(frames)))
    return frames[-1].final


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
    assert dead.server is not None
    await dead.server.server.stop(None)  # gone without telling anyone
    for i in range(3):
        fin = final(await generate(mesh, request(f"hi {i}")))
        assert fin.route.worker_id == "edge-1"
    replica = next(r for r in mesh.router.registry.replicas if r.address == dead.address)
    assert not replica.healthy


async def test_unavailable_before_first_token_fails_over_to_the_other_tier(mesh: Mesh) -> None:
    mesh.edges[0].fail_next = grpc.StatusCode.UNAVAILABLE
    mesh.edges[1].fail_next = grpc.StatusCode.UNAVAILABLE
    fin = final(await generate(mesh, request("hi")))
    assert (fin.route.tier, fin.route.reason) == (pb.TIER_CLOUD, "spill")


async def test_unavailable_everywhere_before_first_token_is_unavailable(mesh: Mesh) -> None:
    mesh.edges[0].fail_next = grpc.StatusCode.UNAVAILABLE
    mesh.edges[1].fail_next = grpc.StatusCode.UNAVAILABLE
    mesh.cloud.fail_next = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(mesh, request("hi"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "fake failure" not in (err.value.details() or "")  # worker text is not passed on
    await mesh.router.registry.probe_all()
    mesh.edges[0].fail_next = grpc.StatusCode.UNAVAILABLE
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
    assert {f.turn for f in first} == {0} and [f.sequence for f in first] == [0, 1, 2, 3]
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


async def test_worker_dying_mid_stream_is_resumed_elsewhere_without_duplicate_or_gap(mesh: Mesh) -> None:
    bypass = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
    undisturbed = tokens(await generate(mesh, request("Resume me", 12, routing=bypass)))
    for e in mesh.edges:
        e.die_after_tokens = 5
    frames = await generate(mesh, request("Resume me", 12, routing=bypass))
    fin = final(frames)  # also checks the sequence numbers
    assert tokens(frames) == undisturbed
    assert fin.route.reason == "failover" and fin.usage.completion_tokens == 12
    # Both edges die after 5 tokens each: edge -> edge (resumed at 5) -> cloud (resumed at 10).
    resumed = sorted((list(s.resume_token_ids) for w in mesh.all() for s in w.starts if s.resume_token_ids), key=len)
    assert resumed == [undisturbed[:5], undisturbed[:10]]


async def test_failover_budget_is_bounded(mesh: Mesh) -> None:
    for w in mesh.all():
        w.die_after_tokens = 2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(
            mesh, request("Resume me again", 12, routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS))
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sum(1 for w in mesh.all() for s in w.starts if s.resume_token_ids) == 2  # failovers_after_first_token


async def test_collapsed_identical_requests_reach_one_worker(mesh: Mesh) -> None:
    for w in mesh.all():
        w.token_delay_s = 0.01
    results = await asyncio.gather(*(generate(mesh, request("Same question", 8)) for _ in range(5)))
    assert sum(len(w.starts) for w in mesh.all()) == 1
    assert all(tokens(r) == tokens(results[0]) for r in results)
    assert sorted(final(r).route.reason for r in results).count("collapsed") >= 1


async def test_client_cancel_of_a_collapsed_request_stops_the_worker_when_all_left(mesh: Mesh) -> None:
    for w in mesh.all():
        w.token_delay_s = 0.05
    calls = [mesh.stub.Generate(request("Cancel us", 200), metadata=META) for _ in range(2)]
    for call in calls:
        await call.read()  # first token of each
    calls[0].cancel()
    worker = next(w for w in mesh.all() if w.starts)
    assert not worker.cancelled.is_set()
    calls[1].cancel()
    await asyncio.wait_for(worker.cancelled.wait(), 5)


async def test_stalled_worker_is_ejected_and_the_stream_resumed(mesh: Mesh) -> None:
    bypass = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
    undisturbed = tokens(await generate(mesh, request("Stall here", 8, routing=bypass)))
    for e in mesh.edges:
        e.stall_after_tokens = 3
    frames = await generate(mesh, request("Stall here", 8, routing=bypass))
    assert tokens(frames) == undisturbed and final(frames).route.reason == "failover"
    assert any(r.ejections for r in mesh.router.registry.replicas if r.tier.value == "edge")


async def test_self_registered_worker_joins_by_heartbeat_and_leaves(mesh: Mesh) -> None:
    from services.common.pb.meshserve.internal.v1 import registry_pb2, registry_pb2_grpc, worker_pb2

    extra = await start_fake("cloud-9", pb.TIER_CLOUD, TOKEN)
    registry = registry_pb2_grpc.WorkerRegistryStub(mesh.channel)
    beat = registry_pb2.WorkerHeartbeat(
        address=extra.address, tier=pb.TIER_CLOUD, stats=worker_pb2.WorkerStats(worker_id="cloud-9")
    )
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry.Heartbeat(beat)  # no internal credential
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        reply = await registry.Heartbeat(beat, metadata=META)
        assert reply.ttl_ms > 0
        assert any(r.address == extra.address and r.healthy for r in mesh.router.registry.replicas)
        mesh.cloud.fail_next = grpc.StatusCode.UNAVAILABLE  # the static cloud replica fails: use the new one
        fin = final(
            await generate(mesh, request(LONG_PROMPT, routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)))
        )
        assert fin.route.tier == pb.TIER_CLOUD and fin.route.worker_id == "cloud-9"
        beat.leaving = True
        await registry.Heartbeat(beat, metadata=META)
        assert all(r.address != extra.address for r in mesh.router.registry.replicas)
    finally:
        assert extra.server is not None
        await extra.server.stop()


async def test_registered_worker_without_heartbeats_expires(mesh: Mesh) -> None:
    registry = mesh.router.registry
    extra = await start_fake("edge-9", pb.TIER_EDGE, TOKEN)
    try:
        registry.heartbeat_ttl_s = 0.01
        await registry.heartbeat(extra.address, TierName.EDGE, worker_id="edge-9")
        assert any(r.address == extra.address for r in registry.replicas)
        await asyncio.wait_for(_until_gone(registry, extra.address), 5)
    finally:
        assert extra.server is not None
        await extra.server.stop()


async def _until_gone(registry: Registry, address: str) -> None:
    while any(r.address == address for r in registry.replicas):
        await registry.probe_all()
