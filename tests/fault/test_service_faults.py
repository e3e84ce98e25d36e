"""Redis and gateway faults under load, through the real mesh.

Redis: the limiter is fail-open by default (``MESHSERVE_GATEWAY_RATE_LIMIT_FAILURE_MODE=open``), so
stopping Redis in the middle of a load must fail no request at all; the response cache behaves as a
miss. After Redis is back (empty), the limiter writes its buckets again and repeated requests hit the
cache again. The fail-closed mode (UNAVAILABLE while Redis is down) is
tests/integration/gateway/test_ratelimit.py; the router's cache outage with fake workers is
tests/integration/store/test_outage_under_load.py.

Gateway: ``kill -9`` mid-stream ends every open stream promptly with UNAVAILABLE (no hang, no frame
after a gap), the router cancels the orphaned generations, calls while it is down fail fast with
UNAVAILABLE, and after a restart on the same port the same client channel works again and produces
the undisturbed output. The full suite also stops it gracefully (SIGTERM): in-flight streams
finish whole, then the same checks.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis.asyncio as aioredis

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.local.mesh import Mesh
from services.store.gateway_keys import rate_limit_keys
from tests.fault.conftest import FULL, STREAM_BOUND_S, Stream, auth, gateway_restart_under_load, greedy
from tests.helpers import RedisServer

pytestmark = pytest.mark.fault

QUESTIONS = [f"Name a colour, number {i}." for i in range(6)]


async def _short_request(stub, prompt: str) -> Stream:
    """One short cacheable greedy request, recorded like a load stream."""
    stream = Stream(prompt)
    try:
        req = greedy(prompt, 4, pb.CACHE_POLICY_USE)
        async for frame in stub.Generate(req, metadata=auth(), timeout=STREAM_BOUND_S):
            stream.sequences.append(frame.sequence)
            stream.tokens.extend(frame.token_ids)
            if frame.HasField("final"):
                stream.final = frame.final
    except grpc.aio.AioRpcError as exc:
        stream.error, stream.details = exc.code(), exc.details() or ""
    return stream


async def test_redis_stopped_and_restarted_under_load(fault_stub, fault_mesh: Mesh, fault_redis: RedisServer) -> None:
    concurrency, per_phase = (4, 40) if FULL else (3, 12)
    phases: dict[str, list[Stream]] = {"before": [], "down": [], "after": []}
    phase = "before"
    progress = asyncio.Event()

    async def client(i: int) -> None:
        n = 0
        while phase != "done" and n < 500:  # bounded
            current = phase
            stream = await _short_request(fault_stub, QUESTIONS[(i + n) % len(QUESTIONS)])
            if current == phase:  # only requests that ran entirely within one phase count for it
                phases[current].append(stream)
                progress.set()
            n += 1

    async def until(name: str, count: int) -> None:
        while len(phases[name]) < count:
            progress.clear()
            await progress.wait()

    clients = [asyncio.create_task(client(i)) for i in range(concurrency)]
    try:
        await asyncio.wait_for(until("before", per_phase), 120)
        await asyncio.to_thread(fault_redis.stop)
        phase = "down"
        await asyncio.wait_for(until("down", per_phase), 120)
        phase = "restarting"
        await asyncio.to_thread(fault_redis.start)
        phase = "after"
        await asyncio.wait_for(until("after", per_phase), 120)
    finally:
        phase = "done"
        await asyncio.gather(*clients)

    for name, streams in phases.items():
        for stream in streams:  # fail-open: nothing fails, every stream whole
            assert stream.error is None, f"{name}: {stream.error} {stream.details}"
            assert stream.sequences == list(range(len(stream.sequences)))
            assert stream.final is not None
    assert not any(s.final.route.cache_hit for s in phases["down"] if s.final), "a cache hit without Redis"

    # Recovery: the limiter writes its buckets to the restarted (empty) Redis, and the cache serves hits.
    client_ = aioredis.Redis.from_url(fault_redis.url)
    try:
        for _ in range(100):  # bounded: the limiter and the cache retry Redis after ~1 s
            hit = await _short_request(fault_stub, QUESTIONS[0])
            assert hit.error is None, hit.details
            if (
                hit.final is not None
                and hit.final.route.cache_hit
                and await client_.exists(rate_limit_keys("dev").requests)
            ):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("after the restart, no cache hit or no rate-limit bucket in Redis")
    finally:
        await client_.aclose()


@pytest.mark.parametrize("how", ["kill_9", *(["sigterm"] if FULL else [])])
async def test_gateway_restart_under_load(fault_mesh: Mesh, how: str) -> None:
    # kill_9: the router (a process of its own) cancels the orphaned generations.
    await gateway_restart_under_load(fault_mesh, how)
