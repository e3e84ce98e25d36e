"""Tracing in `meshserve up`'s default layout: the router runs inside the gateway's process.

One request still yields one connected trace, but with one RPC span fewer: the router's phases are
the gateway process's own spans, under the gateway's RPC span, and the worker's RPC span hangs from
that same span (the trace context travels in the stream transport's open frame). The rate-limit
reservation overlaps the routing there (docs/gateway.md, *Admission overlapped with routing*), so
unlike the split layout's test this one checks containment, not that the phases are disjoint.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import Mesh, MeshConfig
from tests.e2e.conftest import _sink, auth
from tests.e2e.test_tracing import GATEWAY_RPC, WORKER_RPC, trace_of
from tests.helpers import RedisServer

pytestmark = pytest.mark.e2e

GATEWAY_PHASES = [
    "gateway.auth",
    "gateway.rate_limit",
    "router.tokenize",
    "router.cache_lookup",
    "router.route_decision",
]
WORKER_PHASES = ["worker.queue_wait", "worker.prefill", "worker.first_token", "worker.stream_end"]


@pytest.fixture(scope="module")
async def traced(redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Mesh, Path]]:
    spans_dir = tmp_path_factory.mktemp("spans_embedded")
    env = {"MESHSERVE_TRACING_EXPORTER": "file", "MESHSERVE_TRACING_DIR": str(spans_dir)}
    config = MeshConfig(edge_workers=1, cloud_workers=0, redis_url=redis_srv.url, extra_env=env)
    assert config.embed_router  # the default
    async with Mesh(config, sink=_sink) as mesh:
        yield mesh, spans_dir


async def test_one_request_is_one_connected_trace_through_the_gateways_own_router(
    traced: tuple[Mesh, Path],
) -> None:
    mesh, folder = traced
    prompt = f"Tell me a story about a lighthouse keeper named {uuid.uuid4().hex[:6]}"
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=6, temperature=0.0))
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        frames = [f async for f in inference_pb2_grpc.InferenceStub(channel).Generate(request, metadata=auth())]
    assert frames[-1].HasField("final") and frames[-1].final.route.tier == pb.TIER_EDGE

    want = 2 + len(GATEWAY_PHASES) + len(WORKER_PHASES)
    spans = await trace_of(
        folder, lambda s: s["name"] == GATEWAY_RPC and s["service"] == "gateway" and not s["parent_span_id"], want
    )
    by_name = {(s["service"], s["name"]): s for s in spans}
    assert len(by_name) == len(spans) == want, sorted(by_name)  # one of each; no router RPC span

    gateway_rpc = by_name[("gateway", GATEWAY_RPC)]
    worker_rpc = by_name[("edge_worker", WORKER_RPC)]
    assert worker_rpc["parent_span_id"] == gateway_rpc["span_id"]
    for rpc in (gateway_rpc, worker_rpc):  # findable by the request id the caller got back
        assert rpc["attributes"]["meshserve.request_id"] == frames[-1].request_id != ""
        assert rpc["attributes"]["meshserve.tenant"] == "dev"
    for name in GATEWAY_PHASES:
        span = by_name[("gateway", name)]
        assert span["parent_span_id"] == gateway_rpc["span_id"], name
        assert gateway_rpc["start_ns"] <= span["start_ns"] and span["end_ns"] <= gateway_rpc["end_ns"], name
    for name in WORKER_PHASES:
        assert by_name[("edge_worker", name)]["parent_span_id"] == worker_rpc["span_id"], name
    # The request's order: authenticated first; routed before the worker queued it; the worker's
    # phases in order.
    auth_span, decision = by_name[("gateway", "gateway.auth")], by_name[("gateway", "router.route_decision")]
    assert all(auth_span["end_ns"] <= by_name[("gateway", n)]["start_ns"] for n in GATEWAY_PHASES[1:])
    assert decision["end_ns"] <= by_name[("edge_worker", "worker.queue_wait")]["start_ns"]
    worker = [by_name[("edge_worker", n)] for n in WORKER_PHASES]
    assert all(a["end_ns"] <= b["start_ns"] for a, b in itertools.pairwise(worker))
    assert by_name[("gateway", "router.route_decision")]["attributes"]["meshserve.tier"] == "edge"
