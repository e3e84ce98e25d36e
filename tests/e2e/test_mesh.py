"""End to end through the real mesh: gateway -> router -> edge/cloud workers, real Redis and model.

Test order matters only for the last test, which stops the edge workers.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import Mesh
from tests.e2e.conftest import auth, worker_stub

pytestmark = pytest.mark.e2e

SHORT = "The capital of France is"
LONG = " ".join(["The history of the river valley and the towns along it is long and full of change."] * 8)


def greedy(
    prompt: str, max_tokens: int, tier: int = pb.TIER_AUTO, policy: int = pb.CACHE_POLICY_USE
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        routing=pb.RoutingOptions(tier=tier, cache_policy=policy),
    )


async def collect(
    stub: inference_pb2_grpc.InferenceStub, request: pb.GenerateRequest
) -> tuple[list[int], str, pb.Final]:
    tokens: list[int] = []
    text = ""
    final = None
    expected_seq = 0
    async for frame in stub.Generate(request, metadata=auth()):
        assert frame.sequence == expected_seq, "frames must be numbered without gaps"
        expected_seq += 1
        tokens.extend(frame.token_ids)
        text += frame.text
        if frame.HasField("final"):
            final = frame.final
    assert final is not None, "the stream must end with a final frame"
    return tokens, text, final


async def test_short_prompt_is_served_by_edge_and_equals_direct_onnx_greedy(gateway, mesh: Mesh) -> None:
    tokens, text, final = await collect(gateway, greedy(SHORT, 24, policy=pb.CACHE_POLICY_BYPASS))
    assert final.route.tier == pb.TIER_EDGE
    assert final.route.worker_id.startswith("edge-")
    assert final.usage.completion_tokens == len(tokens) > 0
    assert text.strip()
    from tests.reference import edge_greedy

    assert tokens == await asyncio.to_thread(edge_greedy, SHORT, 24)


async def test_long_prompt_is_served_by_cloud_and_equals_direct_transformers_greedy(gateway) -> None:
    tokens, _text, final = await collect(gateway, greedy(LONG, 16, policy=pb.CACHE_POLICY_BYPASS))
    assert final.route.tier == pb.TIER_CLOUD
    assert final.usage.prompt_tokens > 64
    from tests.reference import cloud_greedy

    assert tokens == await asyncio.to_thread(cloud_greedy, LONG, 16)


async def test_repeated_greedy_request_is_served_from_redis_cache(gateway) -> None:
    prompt = "Name three colours of the rainbow."
    first_tokens, first_text, first = await collect(gateway, greedy(prompt, 12))
    assert not first.route.cache_hit
    again_tokens, again_text, again = await collect(gateway, greedy(prompt, 12))
    assert again.route.cache_hit
    assert (again_tokens, again_text) == (first_tokens, first_text)
    assert again.finish_reason == first.finish_reason


async def test_sampled_request_without_seed_is_not_cached(gateway) -> None:
    request = pb.GenerateRequest(prompt="Say something.", sampling=pb.SamplingParams(max_tokens=4, temperature=0.8))
    for _ in range(2):
        _tokens, _text, final = await collect(gateway, request)
        assert not final.route.cache_hit


async def test_cancel_mid_stream_stops_worker_generation(gateway, mesh: Mesh) -> None:
    channel, worker = await worker_stub(mesh.workers("cloud")[0].address)
    meta = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)
    try:
        before = await worker.Stats(worker_pb2.StatsRequest(), metadata=meta)
        call = gateway.Generate(greedy(LONG, 400, tier=pb.TIER_CLOUD, policy=pb.CACHE_POLICY_BYPASS), metadata=auth())
        received = 0
        async for frame in call:
            received += len(frame.token_ids)
            if received >= 3:
                break
        call.cancel()
        stats = before
        for _ in range(200):  # bounded: the worker must go idle within ~10 s
            stats = await worker.Stats(worker_pb2.StatsRequest(), metadata=meta)
            if stats.active_sequences == 0 and stats.sequences_cancelled_total > before.sequences_cancelled_total:
                break
            await asyncio.sleep(0.05)
        assert stats.sequences_cancelled_total == before.sequences_cancelled_total + 1
        assert stats.active_sequences == 0
        settled = stats.tokens_generated_total
        await asyncio.sleep(0.5)  # observing that nothing more happens
        after = await worker.Stats(worker_pb2.StatsRequest(), metadata=meta)
        assert after.tokens_generated_total == settled
        assert settled - before.tokens_generated_total < 100, "generation must stop long before max_tokens"
    finally:
        await channel.close()


async def test_bad_api_key_is_unauthenticated(gateway) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in gateway.Generate(greedy(SHORT, 4), metadata=auth("not-a-key")):
            pass
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gateway.Complete(greedy(SHORT, 4))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "request_",
    [
        pb.GenerateRequest(prompt="", sampling=pb.SamplingParams(max_tokens=4)),
        pb.GenerateRequest(prompt="word " * 200_000, sampling=pb.SamplingParams(max_tokens=4)),
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=4, temperature=7.0)),
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=4, top_p=1.5)),
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=10_000_000)),
    ],
    ids=["empty", "oversized", "temperature", "top_p", "max_tokens"],
)
async def test_invalid_requests_get_invalid_argument_with_one_line_message(gateway, request_) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in gateway.Generate(request_, metadata=auth()):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details and "\n" not in details and "Traceback" not in details


async def test_complete_and_list_models(gateway) -> None:
    reply = await gateway.Complete(greedy(SHORT, 8), metadata=auth())
    assert reply.HasField("final") and reply.token_ids and reply.text
    models = await gateway.ListModels(pb.ListModelsRequest(), metadata=auth())
    assert any(m.id == "smollm2-135m-instruct" for m in models.models)


async def test_chat_two_turns_and_a_cancel_on_one_stream(gateway) -> None:
    outbox: asyncio.Queue[pb.ChatRequest | None] = asyncio.Queue()

    async def requests():
        while (item := await outbox.get()) is not None:
            yield item

    def turn(text: str, max_tokens: int) -> pb.ChatRequest:
        return pb.ChatRequest(
            turn=pb.ChatTurn(
                messages=[pb.ChatMessage(role="user", content=text)],
                sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
            )
        )

    call = gateway.Chat(requests(), metadata=auth())
    frames = call.__aiter__()

    async def until_final(turn_index: int, cancel_after: int | None = None) -> tuple[str, pb.Final]:
        text, seq = "", 0
        while True:
            frame = await frames.__anext__()
            assert frame.turn == turn_index and frame.sequence == seq
            seq += 1
            text += frame.text
            if frame.HasField("final"):
                return text, frame.final
            if cancel_after is not None and seq == cancel_after:
                await outbox.put(pb.ChatRequest(cancel=pb.Cancel()))

    await outbox.put(turn("What is the capital of France?", 16))
    first_text, first = await until_final(0)
    assert first_text and first.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    await outbox.put(turn("Now write a very long story about it.", 300))
    _text, cancelled = await until_final(1, cancel_after=2)
    assert cancelled.finish_reason == pb.FINISH_REASON_CANCELLED
    await outbox.put(turn("Thanks. One word: yes or no?", 8))
    _third_text, third = await until_final(2)
    assert third.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert third.usage.prompt_tokens > first.usage.prompt_tokens, "later turns carry the conversation"
    await outbox.put(None)
    with pytest.raises(StopAsyncIteration):
        await frames.__anext__()


async def test_every_service_serves_prometheus_metrics(gateway, mesh: Mesh) -> None:
    import urllib.request

    await collect(gateway, greedy("Metrics please", 4, policy=pb.CACHE_POLICY_BYPASS))

    def scrape(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return reply.read().decode()

    for name in ("gateway", "router", "cloud-0"):
        port = mesh.processes[name].metrics_port
        assert port, f"{name} must log its metrics port"
        text = await asyncio.to_thread(scrape, port)
        assert "meshserve_time_to_first_token_seconds" in text, name
        assert "meshserve_request_duration_seconds" in text, name
    gateway_text = await asyncio.to_thread(scrape, mesh.processes["gateway"].metrics_port or 0)
    assert 'meshserve_time_to_first_token_seconds_count{service="gateway"' in gateway_text


async def test_every_service_serves_health_and_reflection(mesh: Mesh) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    expected = {"gateway": "meshserve.v1.Inference", "router": "meshserve.v1.Inference"}
    expected |= {w.name: "meshserve.internal.v1.Worker" for w in mesh.workers("edge") + mesh.workers("cloud")}
    for name, service in expected.items():
        address = mesh.processes[name].address
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name

        def services(addr: str = address) -> list[str]:
            with grpc.insecure_channel(addr) as sync_channel:
                return list(ProtoReflectionDescriptorDatabase(sync_channel).get_services())

        assert service in await asyncio.to_thread(services), name
