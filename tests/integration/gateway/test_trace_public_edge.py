"""W3C trace context from public callers, through the real HTTP adapter and the real gateway (tracing
on, spans in memory) to a fake router that records its metadata: the caller's trace is joined, but
sampling is the gateway's own decision, and a malformed traceparent is ignored."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

import aiohttp
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id

from services.cli.client import wait_for_health
from services.common import tracing
from services.common.config import ServiceSettings
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import start_server
from services.common.tracing import TracingSettings
from services.gateway.http.config import HttpAdapterSettings
from services.gateway.http.server import serve as serve_http
from services.gateway.server import serve
from services.gateway.servicer import SERVICE_NAME
from tests.integration.gateway.conftest import INTERNAL_TOKEN, KEYS, FakeRouter, gateway_settings

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"


@dataclass
class Edge:
    router: FakeRouter
    spans: InMemorySpanExporter
    base_url: str


@pytest.fixture
async def edge(request: pytest.FixtureRequest) -> AsyncIterator[Edge]:
    """Fake router, traced gateway (sample ratio from the test's param), HTTP adapter in front."""
    spans = InMemorySpanExporter()
    tracing.setup_tracing("gateway", TracingSettings(sample_ratio=request.param), exporter=spans)
    async with AsyncExitStack() as stack:
        stack.callback(tracing.reset_tracing)
        router = FakeRouter()
        router_server = await start_server(
            ServiceSettings(host="127.0.0.1", port=0, metrics_port=-1, internal_token=INTERNAL_TOKEN),
            register=lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(router, s),
            service_names=[SERVICE_NAME],
            internal=True,
        )
        stack.push_async_callback(router_server.stop)
        gateway = await serve(gateway_settings(f"127.0.0.1:{router_server.port}"))
        stack.push_async_callback(gateway.stop)
        await wait_for_health(f"127.0.0.1:{gateway.port}", 10.0, SERVICE_NAME)
        settings = HttpAdapterSettings(host="127.0.0.1", port=0, gateway_address=f"127.0.0.1:{gateway.port}")
        runner, port, channel = await serve_http(settings)
        stack.push_async_callback(channel.close)
        stack.push_async_callback(runner.cleanup)
        yield Edge(router, spans, f"http://127.0.0.1:{port}")


async def complete(edge: Edge, **headers: str) -> None:
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEYS['acme']}", **headers}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{edge.base_url}/v1/completions", json=body, headers=headers) as reply,
    ):
        assert reply.status == 200, await reply.text()
        assert (await reply.json())["choices"][0]["text"] == "done"


def gateway_span(edge: Edge) -> object:
    """The gateway's SERVER span: the in-process fake router's is its child (one tracer per process)."""
    servers = [s for s in edge.spans.get_finished_spans() if s.kind is SpanKind.SERVER]
    ours = {s.context.span_id for s in servers if s.context}
    (span,) = [s for s in servers if s.parent is None or s.parent.span_id not in ours]
    assert len(servers) == 2  # gateway and router, one trace
    return span


@pytest.mark.parametrize("edge", [1.0], indirect=True)
async def test_http_callers_trace_is_joined_and_reaches_the_router(edge: Edge) -> None:
    await complete(edge, traceparent=f"00-{TRACE_ID}-{SPAN_ID}-00", tracestate="vendor=abc")
    span = gateway_span(edge)
    assert format_trace_id(span.context.trace_id) == TRACE_ID  # type: ignore[attr-defined]
    assert format_span_id(span.parent.span_id) == SPAN_ID  # type: ignore[attr-defined]  # under the caller's span
    assert span.context.trace_state.get("vendor") == "abc"  # type: ignore[attr-defined]
    seen = edge.router.seen[-1].metadata
    _, trace_id, parent, flags = seen["traceparent"].split("-")
    # Sampled although the caller said not to: our ratio (1.0) decides; the router's parent is the gateway's span.
    assert (trace_id, parent, flags) == (TRACE_ID, format_span_id(span.context.span_id), "01")  # type: ignore[attr-defined]


@pytest.mark.parametrize("edge", [0.0], indirect=True)
async def test_a_callers_sampled_flag_does_not_force_recording(edge: Edge) -> None:
    await complete(edge, traceparent=f"00-{TRACE_ID}-{SPAN_ID}-01")
    assert edge.spans.get_finished_spans() == ()
    _, trace_id, _, flags = edge.router.seen[-1].metadata["traceparent"].split("-")
    assert (trace_id, flags) == (TRACE_ID, "00")  # still correlated by trace id, not sampled downstream


@pytest.mark.parametrize("edge", [1.0], indirect=True)
async def test_a_malformed_traceparent_is_ignored(edge: Edge) -> None:
    await complete(edge, traceparent="00-this-is-not-a-trace-01", tracestate="vendor=abc")
    span = gateway_span(edge)
    assert span.parent is None  # type: ignore[attr-defined]  # a trace of our own
    assert edge.router.seen[-1].metadata["traceparent"].split("-")[1] == format_trace_id(span.context.trace_id)  # type: ignore[attr-defined]
