"""Tracing: off by default, settings errors, context across a hop, exporters (file and real OTLP)."""

from __future__ import annotations

import contextvars
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN

from services.common import tracing
from services.common.config import load_settings
from services.common.errors import ConfigError
from services.common.interceptors import outbound_metadata
from services.common.tracing import TracingSettings

T = TypeVar("T")


@pytest.fixture
def memory() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.setup_tracing("unit", exporter=exporter) is not None
    yield exporter
    tracing.reset_tracing()


def test_off_by_default_installs_nothing_and_costs_nothing() -> None:
    assert tracing.setup_tracing("unit", TracingSettings()) is None
    assert not tracing.enabled()
    assert tracing.span("a") is tracing.span("b")  # one shared no-op context manager
    with tracing.span("a") as current:
        assert current is INVALID_SPAN
    assert tracing.start_span("phase") is INVALID_SPAN
    assert not any(key in tracing.TRACE_HEADERS for key, _ in outbound_metadata("token"))


def test_settings_come_from_env_and_yaml_with_clear_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MESHSERVE_TRACING_EXPORTER", "file")
    with pytest.raises(ConfigError, match="MESHSERVE_TRACING_DIR"):
        load_settings(TracingSettings)  # type: ignore[type-var]
    monkeypatch.setenv("MESHSERVE_TRACING_EXPORTER", "jaeger")
    with pytest.raises(ConfigError, match="MESHSERVE_TRACING_EXPORTER"):
        load_settings(TracingSettings)  # type: ignore[type-var]
    monkeypatch.delenv("MESHSERVE_TRACING_EXPORTER")
    config = tmp_path / "mesh.yaml"
    config.write_text("tracing:\n  exporter: otlp\n  otlp_endpoint: http://collector:4317\n  sample_ratio: 0.25\n")
    monkeypatch.setenv("MESHSERVE_CONFIG", str(config))
    settings = load_settings(TracingSettings)  # type: ignore[type-var]
    assert (settings.exporter, settings.otlp_endpoint, settings.sample_ratio) == ("otlp", "http://collector:4317", 0.25)


def in_call(fn: Callable[[], T]) -> T:
    """Run ``fn`` as a traced call would: in a fresh context, under a SERVER span."""

    def run() -> T:
        server = tracing.start_server_span("test.v1.T/Call", ())
        try:
            return fn()
        finally:
            server.end()

    return contextvars.Context().run(run)


def test_context_crosses_a_hop_in_metadata_only(memory: InMemorySpanExporter) -> None:
    def call() -> tuple[tuple[tuple[str, str], ...], int]:
        with tracing.span("caller.work") as work:
            return outbound_metadata("token"), work.get_span_context().trace_id

    metadata, trace_id = in_call(call)
    assert dict(metadata)["traceparent"].split("-")[1] == f"{trace_id:032x}"

    def serve() -> None:  # a fresh context, as in another process: only the metadata links them
        server = tracing.start_server_span("svc.v1.S/M", metadata)
        with tracing.span("callee.phase"):
            pass
        server.end()

    contextvars.Context().run(serve)
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert set(spans) == {"test.v1.T/Call", "caller.work", "svc.v1.S/M", "callee.phase"}
    assert {s.context.trace_id for s in spans.values() if s.context} == {trace_id}
    links = {
        n: (s.parent.span_id if s.parent else None, s.context.span_id if s.context else None) for n, s in spans.items()
    }
    assert links["svc.v1.S/M"][0] == links["caller.work"][1]
    assert links["callee.phase"][0] == links["svc.v1.S/M"][1]
    assert spans["svc.v1.S/M"].resource.attributes["service.name"] == "unit"


def test_a_call_without_trace_context_starts_a_new_trace(memory: InMemorySpanExporter) -> None:
    def serve() -> None:
        tracing.start_server_span("svc.v1.S/M", (("x-request-id", "r1"),)).end()

    contextvars.Context().run(serve)
    (server,) = memory.get_finished_spans()
    assert server.parent is None and server.context is not None and server.context.is_valid


def test_phases_are_recorded_only_inside_a_recorded_call(memory: InMemorySpanExporter) -> None:
    with tracing.span("background.work"):  # no traced call around it
        tracing.start_span("background.phase").end()
    assert memory.get_finished_spans() == ()


def test_an_unsampled_call_records_nothing_and_tells_the_next_hop(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("unit", TracingSettings(sample_ratio=0.0), exporter=exporter)
    try:

        def call() -> tuple[tuple[str, str], ...]:
            with tracing.span("phase"):
                return outbound_metadata("token")

        metadata = in_call(call)
    finally:
        tracing.reset_tracing()
    assert exporter.get_finished_spans() == ()
    flags = int(dict(metadata)["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 1 == 0  # sampled flag off: the next hop records nothing either


def test_failed_phase_is_marked_with_the_error(memory: InMemorySpanExporter) -> None:
    def call() -> None:
        with pytest.raises(ConfigError), tracing.span("gateway.auth"):
            raise ConfigError("boom")

    in_call(call)
    failed = next(s for s in memory.get_finished_spans() if s.name == "gateway.auth")
    assert failed.status.status_code.name == "ERROR"
    assert failed.events[0].name == "exception"


def test_file_exporter_writes_one_json_line_per_span(tmp_path: Path) -> None:
    settings = TracingSettings(exporter="file", dir=str(tmp_path / "spans"))
    assert tracing.setup_tracing("filesvc", settings) is not None
    try:
        in_call(lambda: tracing.start_span("inner", {"k": 1}).end())
    finally:
        tracing.reset_tracing()
    (path,) = (tmp_path / "spans").glob("filesvc-*.jsonl")
    inner, outer = (json.loads(line) for line in path.read_text().splitlines())
    assert (inner["name"], outer["name"]) == ("inner", "test.v1.T/Call")
    assert outer["kind"] == "SERVER" and outer["parent_span_id"] == ""
    assert inner["parent_span_id"] == outer["span_id"] and inner["trace_id"] == outer["trace_id"]
    assert inner["attributes"] == {"k": 1} and inner["service"] == "filesvc"
    assert outer["start_ns"] <= inner["start_ns"] <= inner["end_ns"] <= outer["end_ns"]


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
async def collector() -> AsyncIterator[tuple[_Collector, int]]:
    servicer = _Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, port
    await server.stop(None)


async def test_otlp_exporter_sends_spans_to_a_collector(collector: tuple[_Collector, int]) -> None:
    import asyncio

    servicer, port = collector
    settings = TracingSettings(exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{port}")
    assert tracing.setup_tracing("otlpsvc", settings) is not None
    in_call(lambda: None)
    await asyncio.to_thread(tracing.reset_tracing)  # shutdown flushes the batch to the collector
    spans = [
        (rs.resource, span)
        for req in servicer.requests
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    assert [s.name for _, s in spans] == ["test.v1.T/Call"]
    resource = {a.key: a.value.string_value for a in spans[0][0].attributes}
    assert resource["service.name"] == "otlpsvc"


def test_bad_tracing_settings_stop_a_worker_with_exit_2_and_one_line() -> None:
    # A process of its own: the worker configures logging for the whole interpreter.
    script = (
        "from services.worker.server import run_worker_process\n"
        "from services.edge_worker.config import EdgeWorkerSettings\n"
        "from tests.unit.worker.fakes import FakeEngine\n"
        "run_worker_process(EdgeWorkerSettings, lambda settings: FakeEngine(), tier='edge')\n"
    )
    env = {**os.environ, "MESHSERVE_TRACING_EXPORTER": "file"}  # without MESHSERVE_TRACING_DIR
    env.pop("MESHSERVE_TRACING_DIR", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "MESHSERVE_TRACING_DIR" in done.stderr and "Traceback" not in done.stderr


def test_otlp_without_its_package_is_a_config_error_saying_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)  # not installed
    with pytest.raises(ConfigError, match=r"pip install 'meshserve\[otlp\]'"):
        tracing.setup_tracing("unit", TracingSettings(exporter="otlp"))
    assert not tracing.enabled()
