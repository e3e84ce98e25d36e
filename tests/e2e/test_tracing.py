"""One request through a real traced mesh yields one connected trace, spans in request order.

The mesh runs as separate processes (same launcher as `meshserve up`): gateway, router, one edge
worker, real Redis and the real model. Each process exports its finished spans as JSON lines
(``MESHSERVE_TRACING_EXPORTER=file``), which is how spans from several processes are collected.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import Mesh, MeshConfig
from tests.e2e.conftest import _sink, auth
from tests.helpers import RedisServer

pytestmark = pytest.mark.e2e

GATEWAY_RPC = "meshserve.v1.Inference/Generate"
WORKER_RPC = "meshserve.internal.v1.Worker/Generate"
PHASES = [
    ("gateway", "gateway.auth"),
    ("gateway", "gateway.rate_limit"),
    ("router", "router.tokenize"),
    ("router", "router.cache_lookup"),
    ("router", "router.route_decision"),
    ("edge_worker", "worker.queue_wait"),
    ("edge_worker", "worker.prefill"),
    ("edge_worker", "worker.first_token"),
    ("edge_worker", "worker.stream_end"),
]


@pytest.fixture(scope="module")
async def traced(redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Mesh, Path]]:
    spans_dir = tmp_path_factory.mktemp("spans")
    env = {"MESHSERVE_TRACING_EXPORTER": "file", "MESHSERVE_TRACING_DIR": str(spans_dir)}
    # The split layout: the trace must cross the gateway -> router gRPC hop as well as router -> worker.
    config = MeshConfig(edge_workers=1, cloud_workers=0, redis_url=redis_srv.url, extra_env=env, embed_router=False)
    async with Mesh(config, sink=_sink) as mesh:
        yield mesh, spans_dir


def read_spans(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines() if line]


async def trace_of(folder: Path, predicate: Any, want: int, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    """The spans of the trace whose root matches ``predicate``, once ``want`` of them were written.

    Spans are written when they end; the worker's last spans end just after the client got its final
    frame, so this polls the files (bounded) instead of assuming they are complete.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        spans = read_spans(folder)
        roots = [s for s in spans if predicate(s)]
        if len(roots) == 1:
            found = [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]
            if len(found) >= want:
                return found
        if time.monotonic() > deadline:
            raise AssertionError(f"trace incomplete after {timeout_s}s: {[s['name'] for s in spans]}")
        await asyncio.sleep(0.05)


async def test_one_request_is_one_connected_trace_with_the_phases_in_order(traced: tuple[Mesh, Path]) -> None:
    mesh, folder = traced
    prompt = f"Tell me a story about a lighthouse keeper named {uuid.uuid4().hex[:6]}"
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=6, temperature=0.0))
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        frames = [f async for f in inference_pb2_grpc.InferenceStub(channel).Generate(request, metadata=auth())]
    assert frames[-1].HasField("final") and frames[-1].final.route.tier == pb.TIER_EDGE
    assert frames[-1].final.usage.completion_tokens > 0

    spans = await trace_of(
        folder, lambda s: s["name"] == GATEWAY_RPC and s["service"] == "gateway" and not s["parent_span_id"], 12
    )
    by_name = {(s["service"], s["name"]): s for s in spans}
    assert len(by_name) == len(spans) == 12, sorted(by_name)  # one of each, nothing else in the trace

    # Parent links: gateway RPC (root) -> router RPC -> worker RPC; each phase under its service's RPC.
    gateway_rpc = by_name[("gateway", GATEWAY_RPC)]
    router_rpc = by_name[("router", GATEWAY_RPC)]
    worker_rpc = by_name[("edge_worker", WORKER_RPC)]
    assert router_rpc["parent_span_id"] == gateway_rpc["span_id"]
    assert worker_rpc["parent_span_id"] == router_rpc["span_id"]
    assert {s["kind"] for s in (gateway_rpc, router_rpc, worker_rpc)} == {"SERVER"}
    for rpc in (gateway_rpc, router_rpc, worker_rpc):  # findable by the request id the caller got back
        assert rpc["attributes"]["meshserve.request_id"] == frames[-1].request_id != ""
        assert rpc["attributes"]["meshserve.tenant"] == "dev"
    rpc_of = {"gateway": gateway_rpc, "router": router_rpc, "edge_worker": worker_rpc}
    for service, name in PHASES:
        assert by_name[(service, name)]["parent_span_id"] == rpc_of[service]["span_id"], name
        assert by_name[(service, name)]["status"] == "UNSET", name

    # Order: the phases start in request order, each after the previous one ended (one machine clock).
    phases = [by_name[key] for key in PHASES]
    assert [s["name"] for s in sorted(phases, key=lambda s: s["start_ns"])] == [name for _, name in PHASES]
    for before, after in itertools.pairwise(phases):
        assert after["start_ns"] >= before["end_ns"], (before["name"], after["name"])
    assert by_name[("router", "router.cache_lookup")]["attributes"]["meshserve.cache.hit"] is False
    assert by_name[("router", "router.route_decision")]["attributes"]["meshserve.tier"] == "edge"
    completion = frames[-1].final.usage.completion_tokens
    assert by_name[("edge_worker", "worker.stream_end")]["attributes"]["meshserve.completion_tokens"] == completion
    # Every phase lies inside the gateway's RPC span.
    assert all(gateway_rpc["start_ns"] <= s["start_ns"] and s["end_ns"] <= gateway_rpc["end_ns"] for s in phases[:7])
