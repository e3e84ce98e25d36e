"""The gateway with the router embedded in its process, as real processes: gateway(+router) → worker, Redis.

The worker is the real worker runtime over the synthetic engine (benchmarks/gateway/instant_worker.py), paced
to one token per 5 ms, and it finds the embedded router the way it finds a standalone one: it
registers and heartbeats to the router's own port. Through the gateway's public port everything
must behave as with a separate router: the same tokens as the worker's own output, unary and chat
calls, clear errors, cancellation reaching the worker; and the router's internal port still refuses
callers without the internal token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import redis.asyncio as aioredis

from services.cli.client import MeshClient, sampling_params
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.processes import ServiceProcess
from services.common.tokenizer import Tokenizer
from services.gateway.keystore import KeyStore
from services.local.mesh import DEV_API_KEY
from services.store.gateway_keys import rate_limit_keys
from tests.integration.gateway.embedded import INTERNAL, embedded_mesh, greedy_request, worker_idle, worker_stats


@pytest.fixture(scope="module")
async def mesh() -> AsyncIterator[dict[str, ServiceProcess | int | str]]:
    async with embedded_mesh() as opened:
        yield {
            "gateway": opened.gateways[0],
            "worker": opened.worker,
            "router_port": opened.router_ports[0],
            "redis_url": opened.redis_url,
        }


async def _leases_held(redis_url: str, tenant: str, within_s: float) -> int:
    """The tenant's stream leases once none is left, or after ``within_s`` (settlements run in tasks
    of their own, so they land a little after the streams end)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        for _ in range(int(within_s / 0.05)):  # polling Redis: there is no event for a settlement
            if (held := int(await client.zcard(rate_limit_keys(tenant).streams))) == 0:
                break
            await asyncio.sleep(0.05)
        return held
    finally:
        await client.aclose()


async def _worker_output(address: str, ids: list[int], max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Generate(metadata=INTERNAL, timeout=30)
        sampling = sampling_params(max_tokens=max_tokens, temperature=0.0)
        start = worker_pb2.WorkerStart(prompt_token_ids=ids, sampling=sampling)
        await call.write(worker_pb2.WorkerRequest(start=start))
        tokens: list[int] = []
        try:
            while not (frame := await call.read()).HasField("final"):
                tokens.extend(frame.token_ids)
        finally:
            call.cancel()
        return tokens


async def test_stream_complete_and_chat_go_through_the_embedded_router(mesh) -> None:
    prompt = "The embedded router answers this prompt."
    expected = await _worker_output(mesh["worker"].address, Tokenizer(model_paths().hf_dir).encode(prompt), 24)
    assert len(expected) == 24
    async with MeshClient(mesh["gateway"].address, DEV_API_KEY) as client:
        frames = [f async for f in client.stub.Generate(greedy_request(prompt), metadata=client.metadata, timeout=30)]
        assert [t for f in frames for t in f.token_ids] == expected
        assert [f.sequence for f in frames] == list(range(len(frames)))
        final = frames[-1].final
        assert final.route.tier == pb.TIER_EDGE and final.route.worker_id == "instant"
        assert final.usage.completion_tokens == 24
        assert len({f.request_id for f in frames}) == 1 and frames[0].request_id
        unary = await client.stub.Complete(greedy_request(prompt), metadata=client.metadata, timeout=30)
        assert list(unary.token_ids) == expected

        call = client.stub.Chat(metadata=client.metadata, timeout=30)
        turns: list[list[pb.ChatResponse]] = []
        for text in ("Hello there.", "And a second turn."):
            turn = pb.ChatTurn(
                messages=[pb.ChatMessage(role="user", content=text)],
                sampling=sampling_params(max_tokens=8, temperature=0.0),
            )
            await call.write(pb.ChatRequest(turn=turn))
            frames_of_turn: list[pb.ChatResponse] = []
            while not (frame := await call.read()).HasField("final"):
                frames_of_turn.append(frame)
            frames_of_turn.append(frame)
            turns.append(frames_of_turn)
        await call.done_writing()
        assert [f.turn for f in turns[0]] == [0] * len(turns[0]) and [f.turn for f in turns[1]] == [1] * len(turns[1])
        assert all(t[-1].final.usage.completion_tokens == 8 for t in turns)
        # Turn 2's prompt is the whole conversation: more prompt tokens than turn 1's.
        assert turns[1][-1].final.usage.prompt_tokens > turns[0][-1].final.usage.prompt_tokens


async def test_errors_are_the_callers_errors(mesh) -> None:
    async with MeshClient(mesh["gateway"].address, "not-a-key") as bad:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await bad.stub.Complete(greedy_request("hi"), metadata=bad.metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with MeshClient(mesh["gateway"].address, DEV_API_KEY) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.stub.Complete(
                greedy_request("hi", model="no-such-model"), metadata=client.metadata, timeout=10
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-model" in (err.value.details() or "")
        long_prompt = "word " * 5000  # within the gateway's character limit, past the model's context with max_tokens
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the router's own check
            await client.stub.Complete(
                greedy_request(long_prompt, max_tokens=4096), metadata=client.metadata, timeout=10
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Traceback" not in (err.value.details() or "")


async def test_caller_cancel_reaches_the_worker(mesh) -> None:
    worker = mesh["worker"].address
    before = await worker_stats(worker)
    async with MeshClient(mesh["gateway"].address, DEV_API_KEY) as client:
        call = client.stub.Generate(greedy_request("A long answer, please.", max_tokens=1000), metadata=client.metadata)
        got = 0
        async for frame in call:
            got += len(frame.token_ids)
            if got >= 2:
                break
        call.cancel()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = await worker_stats(worker)
        if stats.active_sequences == 0 and stats.sequences_cancelled_total > before.sequences_cancelled_total:
            break
        await asyncio.sleep(0.05)
    assert stats.active_sequences == 0
    assert stats.sequences_cancelled_total == before.sequences_cancelled_total + 1
    assert stats.tokens_generated_total - before.tokens_generated_total < 1000  # stopped early, not run out


async def test_the_routers_internal_port_still_needs_the_internal_token(mesh) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mesh['router_port']}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(greedy_request("hi"), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED  # what every internal service answers
        reply = await stub.ListModels(pb.ListModelsRequest(), metadata=INTERNAL, timeout=10)  # with it: served
        assert reply.models


async def test_refused_requests_never_run_on_the_worker(mesh) -> None:
    """Routing starts while the reservation runs (overlap_admission); at most one request of a tenant at
    a time starts on a worker before it is admitted (speculative_starts=1), and a refused one is
    aborted there: of 8 concurrent requests from a tenant allowed 3, exactly 3 run on the worker."""
    client = aioredis.Redis.from_url(mesh["redis_url"])
    try:
        key, _record = await KeyStore(client).create("tight", limits={"requests_per_minute": 3})
    finally:
        await client.aclose()
    worker = mesh["worker"].address
    before = await worker_stats(worker)
    async with MeshClient(mesh["gateway"].address, key) as tight:

        async def one(i: int) -> grpc.StatusCode:
            try:
                await tight.stub.Complete(greedy_request(f"Request {i} of the tight tenant."), metadata=tight.metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    trailers = dict(exc.trailing_metadata() or ())
                    assert int(trailers["retry-after-ms"]) > 0
                return exc.code()
            return grpc.StatusCode.OK

        codes = await asyncio.gather(*(one(i) for i in range(8)))
    assert codes.count(grpc.StatusCode.OK) == 3
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 5
    after = await worker_idle(worker)  # a refused request's speculative start is aborted on the worker
    started = after.sequences_started_total - before.sequences_started_total
    cancelled = after.sequences_cancelled_total - before.sequences_cancelled_total
    assert 3 <= started <= 4, "besides the 3 admitted, at most the one speculative start"
    assert started - cancelled == 3
    assert after.active_sequences == 0


async def test_a_refused_speculative_start_is_aborted_and_its_caller_gets_the_refusal(mesh) -> None:
    """A tenant's request starts on the worker before its reservation is known; when the reservation
    is refused, the worker's turn is cancelled at once and the caller gets RESOURCE_EXHAUSTED. The
    tenant, refused lately, then waits for its reservations: nothing more reaches the worker."""
    client = aioredis.Redis.from_url(mesh["redis_url"])
    try:
        key, _record = await KeyStore(client).create("once", limits={"requests_per_minute": 1, "request_burst": 1})
    finally:
        await client.aclose()
    worker = mesh["worker"].address
    async with MeshClient(mesh["gateway"].address, key) as once:
        first = await once.stub.Complete(
            greedy_request("The one allowed request.", max_tokens=8), metadata=once.metadata
        )
        assert len(first.token_ids) == 8
        before = await worker_stats(worker)
        codes = []
        for i in range(2):  # the first of these may start speculatively; the second may not
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                call = once.stub.Generate(
                    greedy_request(f"Over the limit {i}.", max_tokens=400), metadata=once.metadata
                )
                async for _ in call:
                    pass
            codes.append(refused.value.code())
            assert int(dict(refused.value.trailing_metadata() or ())["retry-after-ms"]) > 0
            if i == 0:
                for _ in range(100):  # bounded: the abort reaches the worker's turn within a few ms
                    stats = await worker_stats(worker)
                    if stats.active_sequences == 0:
                        break
                    await asyncio.sleep(0.02)
                after_first = stats
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
        after = await worker_stats(worker)
    started = after_first.sequences_started_total - before.sequences_started_total
    assert started == after_first.sequences_cancelled_total - before.sequences_cancelled_total <= 1
    assert after_first.tokens_generated_total - before.tokens_generated_total < 400  # aborted, not run out
    assert after.sequences_started_total == after_first.sequences_started_total, "refused lately: no start"


async def test_stream_leases_are_given_back_with_overlapped_admission(mesh) -> None:
    """More sequential streams than the tenant's max_concurrent_streams (16): each one's lease is
    released when it ends (settled once its overlapped reservation is known), so none is refused."""
    async with MeshClient(mesh["gateway"].address, DEV_API_KEY) as client:
        for i in range(20):
            req = greedy_request(f"Lease check {i}.", max_tokens=4)
            frames = [f async for f in client.stub.Generate(req, metadata=client.metadata, timeout=30)]
            assert frames[-1].final.usage.completion_tokens == 4
    assert await _leases_held(mesh["redis_url"], "dev", within_s=10) == 0


async def test_chats_whose_callers_go_away_give_their_stream_slots_back(mesh) -> None:
    """A chat session holds a stream slot until it ends; callers that leave after a turn (their
    channel closed, the stream cancelled) must free it at once, not whenever the gateway's handler
    is garbage collected."""
    turn = pb.ChatTurn(messages=[pb.ChatMessage(role="user", content="Hi.")], sampling=sampling_params(max_tokens=2))
    for _ in range(8):
        async with MeshClient(mesh["gateway"].address, DEV_API_KEY) as client:
            call = client.stub.Chat(metadata=client.metadata, timeout=30)
            await call.write(pb.ChatRequest(turn=turn))
            while not (await call.read()).HasField("final"):
                pass
            await call.done_writing()
    assert await _leases_held(mesh["redis_url"], "dev", within_s=5) == 0
