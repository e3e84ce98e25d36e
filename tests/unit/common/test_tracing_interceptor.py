"""The tracing interceptor on a real grpc.aio server (port 0): SERVER spans, parents, errors, exemptions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span

from services.common import errors, tracing
from services.common.config import ServiceSettings
from services.common.interceptors import outbound_metadata
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import RunningServer, start_server


class Echo(inference_pb2_grpc.InferenceServicer):
    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        with tracing.span("echo.work"):
            return pb.GenerateResponse(text=request.prompt)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(sequence=0, text="partial")
        raise errors.InvalidArgument("prompt is not allowed; send another")


@pytest.fixture
def memory() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("echo", exporter=exporter)
    yield exporter
    tracing.reset_tracing()


@pytest.fixture
async def server(memory: InMemorySpanExporter) -> AsyncIterator[RunningServer]:
    running = await start_server(
        ServiceSettings(port=0),
        lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(Echo(), s),
        [pb.DESCRIPTOR.services_by_name["Inference"].full_name],
    )
    yield running
    await running.stop()


async def test_each_rpc_is_a_server_span_under_the_callers_span(
    server: RunningServer, memory: InMemorySpanExporter
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def traced_caller() -> tuple[pb.GenerateResponse, Span]:  # its own task: its own context
            caller = tracing.start_server_span("client.v1.C/Request", ())
            with tracing.span("client.request") as client:
                reply = await stub.Complete(pb.GenerateRequest(prompt="hi"), metadata=outbound_metadata("t"))
            caller.end()
            return reply, client

        reply, client = await asyncio.create_task(traced_caller())
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in stub.Generate(pb.GenerateRequest(prompt="x"), metadata=outbound_metadata("t")):
                pass
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.text == "hi" and failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = {s.name: s for s in memory.get_finished_spans()}
    rpcs = {"meshserve.v1.Inference/Complete", "meshserve.v1.Inference/Generate"}
    assert set(spans) == {"client.v1.C/Request", "client.request", "echo.work", *rpcs}
    complete = spans["meshserve.v1.Inference/Complete"]
    assert complete.kind.name == "SERVER"
    assert complete.parent is not None and complete.parent.span_id == client.get_span_context().span_id
    work = spans["echo.work"]
    assert work.parent is not None and complete.context is not None
    assert work.parent.span_id == complete.context.span_id
    generate = spans["meshserve.v1.Inference/Generate"]
    assert generate.parent is None  # called outside any span: a trace of its own
    assert generate.status.status_code.name == "ERROR"
    assert dict(generate.attributes or {})["rpc.grpc.status_code"] == "INVALID_ARGUMENT"
