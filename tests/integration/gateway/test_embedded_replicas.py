"""Rate-limit exactness in the deployed layout: two gateway processes, each with the router in its
process (overlapped admission and speculative starts on), one real worker runtime registered with
both routers, one real redis-server (tests/integration/gateway/embedded.py).

Of 3N concurrent requests of one tenant spread over both replicas, for a limit of N, exactly N are
admitted and exactly N run to the end on the worker; a refused request may have started on the
worker speculatively (at most one per replica: a tenant refused lately gets no speculative start) and
is then aborted there. (Turns last ~1 s, so the refusal, one Redis round trip, comes long before one
could end by itself.)
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis.asyncio as aioredis

from services.cli.client import MeshClient
from services.gateway.keystore import KeyStore
from tests.integration.gateway.embedded import embedded_mesh, greedy_request, worker_idle, worker_stats

pytestmark = pytest.mark.integration

N = 6


async def test_two_embedded_replicas_admit_exactly_n_of_3n_and_run_exactly_n() -> None:
    async with embedded_mesh(gateways=2) as mesh:
        redis = aioredis.Redis.from_url(mesh.redis_url)
        try:
            # N at once, then one more per minute: no refill can land while the test runs.
            key, _record = await KeyStore(redis).create("acme", limits={"requests_per_minute": 1, "request_burst": N})
        finally:
            await redis.aclose()
        worker = mesh.worker.address
        before = await worker_stats(worker)
        async with (
            MeshClient(mesh.gateways[0].address, key) as first,
            MeshClient(mesh.gateways[1].address, key) as second,
        ):

            async def one(i: int) -> tuple[grpc.StatusCode, int]:
                client = (first, second)[i % 2]
                request = greedy_request(f"Request {i} of tenant acme.", max_tokens=200)
                try:
                    reply = await client.stub.Complete(request, metadata=client.metadata, timeout=60)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        assert int(dict(exc.trailing_metadata() or ())["retry-after-ms"]) > 0
                    return exc.code(), 0
                return grpc.StatusCode.OK, len(reply.token_ids)

            results = await asyncio.gather(*(one(i) for i in range(3 * N)))
        codes = [code for code, _ in results]
        assert codes.count(grpc.StatusCode.OK) == N, codes
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2 * N, codes
        assert all(tokens == 200 for code, tokens in results if code == grpc.StatusCode.OK)
        after = await worker_idle(worker)
        started = after.sequences_started_total - before.sequences_started_total
        cancelled = after.sequences_cancelled_total - before.sequences_cancelled_total
        assert started - cancelled == N, "exactly the admitted requests ran to the end on the worker"
        assert started <= N + 2, "beyond them, at most one aborted speculative start per replica"
        assert after.active_sequences == 0
