"""The cache admin service inside the real mesh, driven by `meshserve cache` (stats, flush, warm)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import pytest

from services.cli.cache import main as cache_cli
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import Mesh
from tests.e2e.conftest import auth

pytestmark = pytest.mark.e2e


async def cli(*argv: str) -> dict[str, object]:
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return cache_cli(list(argv))

    assert await asyncio.to_thread(run) == 0
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


async def final(gateway: inference_pb2_grpc.InferenceStub, prompt: str, policy: int = 0) -> pb.Final:
    request = pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(max_tokens=4, temperature=0),
        routing=pb.RoutingOptions(cache_policy=policy),  # type: ignore[arg-type]
    )
    frames = [f async for f in gateway.Generate(request, metadata=auth())]
    return frames[-1].final


async def test_cache_stats_flush_and_warm_through_the_cli(
    gateway: inference_pb2_grpc.InferenceStub, mesh: Mesh
) -> None:
    address = ("--address", mesh.cache_address, "--json")
    await final(gateway, "Cache admin e2e: what is a river?")
    assert (await final(gateway, "Cache admin e2e: what is a river?")).route.cache_hit
    stats = await cli(*address, "stats")
    kinds = {k["kind"]: k for k in stats["kinds"]}  # type: ignore[attr-defined]
    assert int(kinds["CACHE_KIND_RESPONSE"]["entries"]) >= 1 and stats["redisMaxmemoryPolicy"] == "allkeys-lru"

    await cli(*address, "flush", "--tenant", "dev")
    assert not (await final(gateway, "Cache admin e2e: what is a river?")).route.cache_hit

    warm = await cli(*address, "warm", "--max-tokens", "4", "You are the e2e system prompt.")
    assert warm == {"warmed": 1, "failed": 0}
    shared = pb.CACHE_POLICY_SHAREABLE_PREFIX
    assert (await final(gateway, "You are the e2e system prompt.", shared)).route.cache_hit
