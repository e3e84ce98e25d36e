"""Trace context from public callers: the edge keeps their trace id but decides sampling itself;
the HTTP adapter forwards only well-formed W3C headers."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id

from services.common import tracing
from services.common.interceptors import outbound_metadata
from services.common.tracing import TracingSettings

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{SPAN_ID}-01"
UNSAMPLED = f"00-{TRACE_ID}-{SPAN_ID}-00"


def traced(sample_ratio: float, **settings: object) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    tracing.setup_tracing("unit", TracingSettings(sample_ratio=sample_ratio, **settings), exporter=exporter)  # type: ignore[arg-type]
    return exporter


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    yield
    tracing.reset_tracing()


def serve(traceparent: str, *, public: bool) -> dict[str, str]:
    """One SERVER span in a fresh context (as in another process); returns what it sends the next hop."""

    def run() -> dict[str, str]:
        span = tracing.start_server_span("svc.v1.S/M", (("traceparent", traceparent),), public=public)
        try:
            return dict(outbound_metadata("token"))
        finally:
            span.end()

    return contextvars.Context().run(run)


def test_public_edge_ignores_a_callers_sampled_flag_but_keeps_its_trace_id() -> None:
    exporter = traced(0.0)
    sent = serve(SAMPLED, public=True)
    assert exporter.get_finished_spans() == ()  # our ratio (0) decided: nothing recorded
    version, trace_id, _, flags = sent["traceparent"].split("-")
    assert (version, trace_id, int(flags, 16) & 1) == ("00", TRACE_ID, 0)  # correlated, not sampled downstream


def test_public_edge_samples_by_its_ratio_whatever_the_caller_says() -> None:
    exporter = traced(1.0)
    serve(UNSAMPLED, public=True)
    (span,) = exporter.get_finished_spans()
    assert span.context is not None and format_trace_id(span.context.trace_id) == TRACE_ID
    assert span.parent is not None and format_span_id(span.parent.span_id) == SPAN_ID  # joined under the caller


def test_internal_hops_follow_the_callers_decision() -> None:
    exporter = traced(0.0)
    serve(SAMPLED, public=False)  # e.g. the router behind the gateway: the gateway already decided
    (span,) = exporter.get_finished_spans()
    assert span.context is not None and format_trace_id(span.context.trace_id) == TRACE_ID


def test_trust_caller_sampling_lets_the_edge_follow_the_caller() -> None:
    exporter = traced(0.0, trust_caller_sampling=True)
    serve(SAMPLED, public=True)
    assert len(exporter.get_finished_spans()) == 1
    serve(UNSAMPLED, public=True)
    assert len(exporter.get_finished_spans()) == 1


def test_public_edge_with_a_malformed_traceparent_starts_its_own_trace() -> None:
    exporter = traced(1.0)
    serve("00-not-a-trace-01", public=True)
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.context is not None and span.context.is_valid


def test_well_formed_trace_headers_are_forwarded() -> None:
    headers = {"traceparent": SAMPLED, "tracestate": "vendor=abc,other=1"}
    assert tracing.caller_trace_headers(headers) == (("traceparent", SAMPLED), ("tracestate", "vendor=abc,other=1"))
    assert tracing.caller_trace_headers({"traceparent": UNSAMPLED}) == (("traceparent", UNSAMPLED),)


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        f"00-{TRACE_ID}-{SPAN_ID}",  # no flags
        f"00-{'0' * 32}-{SPAN_ID}-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero span id
        f"ff-{TRACE_ID}-{SPAN_ID}-01",  # forbidden version
        f"00-{TRACE_ID.upper()}-{SPAN_ID}-01",  # upper-case hex
        f"00-{TRACE_ID}-{SPAN_ID}-01-extra",  # version 00 has no more fields
        f"00-{TRACE_ID}-{SPAN_ID}-0é",
        "00-" + "a" * 600,
        "",
    ],
)
def test_a_malformed_traceparent_is_dropped_with_its_tracestate(traceparent: str) -> None:
    assert tracing.caller_trace_headers({"traceparent": traceparent, "tracestate": "vendor=abc"}) == ()


def test_tracestate_alone_or_unusable_is_dropped() -> None:
    assert tracing.caller_trace_headers({"tracestate": "vendor=abc"}) == ()
    for bad in ("vendor=é", "v=" + "a" * 600, "a\x7fb"):
        assert tracing.caller_trace_headers({"traceparent": SAMPLED, "tracestate": bad}) == (("traceparent", SAMPLED),)
