"""Rate limits through real gateways on port 0, a fake router and a real redis-server.

Exactness: two gateway replicas share one Redis; 3N concurrent requests for a limit of N admit N.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis

from services.common import metadata as md
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.gateway.admission import Gate
from services.gateway.policy import TenantPolicy
from services.gateway.ratelimit import RateLimiter
from services.gateway.server import redis_client
from services.store.gateway_keys import rate_limit_keys
from tests.helpers import redis_server
from tests.integration.gateway.conftest import KEYS, StartFn

pytestmark = pytest.mark.integration

AUTH = ((md.API_KEY, KEYS["acme"]),)
N = 10


def request(max_tokens: int = 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=max_tokens))


async def generate(stub: inference_pb2_grpc.InferenceStub, max_tokens: int = 8) -> grpc.StatusCode:
    """Run one Generate to the end; its status (retry-after-ms is checked on every rejection)."""
    call = stub.Generate(request(max_tokens), metadata=AUTH)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            trailers = dict(exc.trailing_metadata() or ())
            assert int(trailers[md.RETRY_AFTER_MS]) > 0
        return exc.code()
    return grpc.StatusCode.OK


async def test_two_replicas_admit_exactly_n_of_3n_concurrent_requests(start: StartFn) -> None:
    # N requests at once, then one more per minute: no refill can land while the test runs, so the
    # count is exact however slow the machine is.
    mesh = await start(2, requests_per_minute=1, request_burst=N, max_concurrent_streams=0)
    codes = await asyncio.gather(*(generate(mesh.stubs[i % 2]) for i in range(3 * N)))
    assert codes.count(grpc.StatusCode.OK) == N
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2 * N
    assert len(mesh.router.seen) == N, "rejected requests never reach the router"


async def test_two_replicas_hold_exactly_n_concurrent_streams_and_free_them(start: StartFn) -> None:
    mesh = await start(2, requests_per_minute=0, max_concurrent_streams=N)
    mesh.router.mode = "hang"  # each admitted stream sends one frame, then stays open
    calls = [mesh.stubs[i % 2].Generate(request(), metadata=AUTH) for i in range(3 * N)]

    async def first_frame(call: grpc.aio.UnaryStreamCall) -> grpc.StatusCode:
        try:
            await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    codes = await asyncio.gather(*(first_frame(c) for c in calls))
    assert codes.count(grpc.StatusCode.OK) == N
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2 * N
    limiter = RateLimiter(redis_client(mesh.redis_url, 1.0))
    try:
        assert await limiter.open_streams("acme") == N
        for call in calls:
            call.cancel()
        await asyncio.wait_for(all_settled(mesh.gates, N), 10)
        assert await limiter.open_streams("acme") == 0, "cancelled streams give their slots back"
    finally:
        await limiter.close()
    mesh.router.mode = "ok"
    assert await generate(mesh.stubs[0]) == grpc.StatusCode.OK


async def all_settled(gates: list[Gate], total: int) -> None:
    """Return once the gates together have settled ``total`` tickets."""
    while sum(g.settled for g in gates) < total:
        waits = [asyncio.create_task(g.wait_settled(g.settled + 1)) for g in gates]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()


async def token_level(url: str, tpm: int) -> float:
    limiter = RateLimiter(redis_client(url, 1.0))
    try:
        return await limiter.tokens_available("acme", TenantPolicy(tokens_per_minute=tpm))
    finally:
        await limiter.close()


async def test_unused_reserved_tokens_are_given_back_when_a_stream_ends_or_is_cancelled(start: StartFn) -> None:
    tpm = 120  # refills 2 tokens/s: the margins below allow ~1.5 s per step
    mesh = await start(1, tokens_per_minute=tpm, requests_per_minute=0, max_concurrent_streams=0)
    gate = mesh.gates[0]
    # "hello" is estimated at 6 prompt tokens: each request reserves 6 + max_tokens 80 = 86 tokens.
    # The fake router reports 5 prompt + 3 completion = 8 used, so 78 come back.
    assert await generate(mesh.stubs[0], max_tokens=80) == grpc.StatusCode.OK
    await asyncio.wait_for(gate.wait_settled(1), 10)
    assert 120 - 8 - 0.5 <= await token_level(mesh.redis_url, tpm) <= 120
    # Without the refund only 34 tokens would be left and this would be rejected.
    assert await generate(mesh.stubs[0], max_tokens=80) == grpc.StatusCode.OK
    await asyncio.wait_for(gate.wait_settled(2), 10)
    assert 120 - 16 - 0.5 <= await token_level(mesh.redis_url, tpm) <= 120 - 16 + 3

    # Cancelled after one token: settles with the estimate (6) + 1 streamed token.
    mesh.router.mode = "hang"
    call = mesh.stubs[0].Generate(request(80), metadata=AUTH)
    await call.read()
    call.cancel()
    await asyncio.wait_for(gate.wait_settled(3), 10)
    assert 120 - 23 - 0.5 <= await token_level(mesh.redis_url, tpm) <= 120 - 23 + 5

    # A request needing more than is left is rejected by the token bucket, with a retry delay.
    mesh.router.mode = "ok"
    call = mesh.stubs[0].Generate(request(110), metadata=AUTH)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens" in (err.value.details() or "")
    assert int(dict(err.value.trailing_metadata() or ())[md.RETRY_AFTER_MS]) >= 1000


async def test_redis_outage_follows_the_failure_mode_and_recovers(start: StartFn) -> None:
    with redis_server() as redis_srv:
        settings = dict(url=redis_srv.url, requests_per_minute=1000, rate_limit_retry_s=0.2)
        open_mesh = await start(1, rate_limit_failure_mode="open", **settings)
        closed_mesh = await start(1, rate_limit_failure_mode="closed", **settings)
        stubs = {"open": open_mesh.stubs[0], "closed": closed_mesh.stubs[0]}

        async def traffic(mode: str) -> list[grpc.StatusCode]:
            return list(await asyncio.gather(*(generate(stubs[mode]) for _ in range(6))))

        assert await traffic("open") == [grpc.StatusCode.OK] * 6
        assert await traffic("closed") == [grpc.StatusCode.OK] * 6

        redis_srv.stop()
        for _ in range(2):  # before and after the limiter's retry pause
            assert await traffic("open") == [grpc.StatusCode.OK] * 6
            assert await traffic("closed") == [grpc.StatusCode.UNAVAILABLE] * 6
            await asyncio.sleep(0.25)  # let the retry pause pass: the limiter probes Redis again

        redis_srv.start()
        for _ in range(50):  # bounded: the first probe after the pause reconnects
            if await generate(stubs["closed"]) == grpc.StatusCode.OK:
                break
            await asyncio.sleep(0.1)
        assert await traffic("closed") == [grpc.StatusCode.OK] * 6
        assert await traffic("open") == [grpc.StatusCode.OK] * 6
        client = redis.Redis.from_url(redis_srv.url)
        try:
            assert client.exists(rate_limit_keys("acme").requests), "limits are enforced in Redis again"
        finally:
            client.close()


async def test_each_chat_turn_counts_a_request_and_the_session_holds_one_stream_slot(start: StartFn) -> None:
    mesh = await start(1, requests_per_minute=1, request_burst=2, max_concurrent_streams=1)
    turn = pb.ChatRequest(
        turn=pb.ChatTurn(messages=[pb.ChatMessage(role="user", content="hi")], sampling=pb.SamplingParams(max_tokens=4))
    )
    session = mesh.stubs[0].Chat(metadata=AUTH)
    for _ in range(2):  # two turns fit the burst of 2; each ends with its final frame
        await session.write(turn)
        while not (await session.read()).HasField("final"):
            pass
    with pytest.raises(grpc.aio.AioRpcError) as other:  # the open session holds the only stream slot
        second = mesh.stubs[0].Chat(metadata=AUTH)
        await second.write(turn)
        await second.read()
    assert other.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await session.write(turn)  # a third turn is over the request limit
    with pytest.raises(grpc.aio.AioRpcError) as third:
        await session.read()
    assert third.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(third.value.trailing_metadata() or ())[md.RETRY_AFTER_MS]) > 0


async def test_the_redis_pool_is_bounded_and_beyond_it_the_failure_mode_applies(start: StartFn, redis_url: str) -> None:
    """redis-py's pool (`redis_pipelined` off): a 1-connection pool and 12 concurrent admissions: the
    gateway never opens a second socket; the calls that find the pool in use fail like an outage
    (closed mode: UNAVAILABLE, never INTERNAL), and once the limiter's retry pause has passed,
    requests are admitted again."""
    client = redis.Redis.from_url(redis_url)

    def gateway_connections() -> int:
        return sum(c.get("name") == "meshserve-gateway" for c in client.client_list())

    try:
        before = gateway_connections()  # other tests' gateways, if any have not closed theirs yet
        gateways = await start(
            1,
            rate_limit_failure_mode="closed",
            redis_max_connections=1,
            rate_limit_retry_s=0.2,
            redis_pipelined=False,
        )
        codes = await asyncio.gather(*(generate(gateways.stubs[0]) for _ in range(12)))
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
        assert grpc.StatusCode.UNAVAILABLE in codes  # the pool was exceeded
        assert gateway_connections() - before <= 1
        for _ in range(50):  # bounded: the limiter tries Redis again after its pause
            if await generate(gateways.stubs[0]) == grpc.StatusCode.OK:
                break
            await asyncio.sleep(0.1)
        gate = gateways.gates[0]
        for _ in range(3):  # one at a time: a settlement still in flight would hold the only connection
            await asyncio.wait_for(gate.drain(), 10)
            assert await generate(gateways.stubs[0]) == grpc.StatusCode.OK
        assert gateway_connections() - before == 1
    finally:
        client.close()


async def test_the_pipelined_limiter_admits_any_number_of_concurrent_requests_over_one_connection(
    start: StartFn, redis_url: str
) -> None:
    """The default: admit and settle scripts share one pipelined connection (services/store/pipelined.py),
    so 40 concurrent admissions open no more sockets, all are admitted, and every stream slot is freed."""
    client = redis.Redis.from_url(redis_url)

    def limiter_connections() -> int:
        return sum(c.get("name") == "meshserve-gateway-limiter" for c in client.client_list())

    try:
        before = limiter_connections()
        gateways = await start(1, rate_limit_failure_mode="closed", requests_per_minute=0, max_concurrent_streams=40)
        codes = await asyncio.gather(*(generate(gateways.stubs[0]) for _ in range(40)))
        assert codes == [grpc.StatusCode.OK] * 40
        assert limiter_connections() - before == 1
        await asyncio.wait_for(all_settled(gateways.gates, 40), 10)
        limiter = RateLimiter(redis_client(redis_url, 1.0))
        try:
            assert await limiter.open_streams("acme") == 0
        finally:
            await limiter.close()
    finally:
        client.close()
