"""OpenTelemetry tracing: setup from typed settings, W3C trace context across hops, cheap spans.

Off by default (``MESHSERVE_TRACING_EXPORTER=none``): nothing is installed, the SDK is not even
imported, :func:`span` returns one shared no-op context manager and :func:`inject` adds nothing, so
the disabled cost per request is a few attribute lookups (measured in ``benchmarks/gateway/tracing.py``).

On: an SDK ``TracerProvider`` whose resource names the service (``service.name``), a
``ParentBased(TraceIdRatioBased(sample_ratio))`` sampler (an internal hop follows its caller's
decision) and one exporter:

- ``otlp``: OTLP/gRPC to ``otlp_endpoint`` through a batching processor. The exporter package is
  optional (``pip install 'meshserve[otlp]'``) and imported only when chosen.
- ``file``: one JSON object per finished span, one line each, in ``<dir>/<service>-<pid>.jsonl``,
  written when the span ends (for debugging, and how the end-to-end test collects spans from every
  process of a real mesh).
- ``console``: the same JSON lines on stderr.

Tests pass their own exporter (e.g. the SDK's ``InMemorySpanExporter``) to :func:`setup_tracing`.

Context crosses hops as W3C ``traceparent``/``tracestate`` gRPC metadata: the client side adds it in
:func:`services.common.interceptors.outbound_metadata` (:func:`inject`), the server side starts the
RPC's SERVER span from it (:func:`start_server_span`, called by
:class:`services.common.tracing_interceptor.TracingInterceptor`). Domain code creates spans with
:func:`span` / :func:`start_span` only (no grpc here); those are phases of a traced call and record
nothing outside one.

At the public edge (the gateway's server, ``start_server_span(..., public=True)``) a caller's
``traceparent`` gives the trace id and parent span (its trace is joined), but not the sampling
decision: that is drawn at random with ``sample_ratio`` here (not from the trace id, which a caller
picks), so a caller cannot make every request recorded; ``trust_caller_sampling`` restores following
it. We keep our own tracer instead of replacing
OpenTelemetry's global provider, which may be set once per process and so would pin in-process
tests to the first setup.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import (
    INVALID_SPAN,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common import metadata as md
from services.common.config import YamlSettings, load_settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace-context metadata keys carried on every internal hop."""

_PROPAGATOR = TraceContextTextMapPropagator()
# Metadata that becomes SERVER span attributes, so a trace can be found by request id or tenant.
_CORRELATION = {md.REQUEST_ID: "meshserve.request_id", md.TENANT: "meshserve.tenant"}
_SERVER_KEYS = frozenset((*TRACE_HEADERS, *_CORRELATION))
_NOOP_SCOPE = contextlib.nullcontext(INVALID_SPAN)
MAX_TRACE_HEADER_CHARS = 512
"""Longest ``tracestate`` forwarded from a public caller (W3C: 32 list members, 512 chars suffice)."""
AttributeValue = str | bool | int | float


class TracingSettings(YamlSettings):
    """Tracing settings, shared by every service: env ``MESHSERVE_TRACING_*``, YAML section ``tracing:``."""

    service: ClassVar[str] = "tracing"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_TRACING_", extra="ignore")

    exporter: Literal["none", "otlp", "file", "console"] = "none"
    """Where spans go: none (tracing off), otlp (a collector), file (JSON lines in ``dir``), console."""
    otlp_endpoint: str = "http://127.0.0.1:4317"
    """OTLP/gRPC collector endpoint (exporter=otlp)."""
    otlp_insecure: bool = True
    """Plaintext to the collector (true) or TLS (false)."""
    dir: str = ""
    """Directory for exporter=file: each process writes ``<service>-<pid>.jsonl`` there."""
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    """Fraction of requests recorded. Internal hops follow their caller's decision; the public edge
    (gateway) draws its own with this ratio, keeping a caller's trace id (see trust_caller_sampling)."""
    trust_caller_sampling: bool = False
    """Let the public edge follow a caller's sampled flag (only when every caller is trusted, e.g. a
    proxy of yours that samples): otherwise any caller could have every request traced."""

    @model_validator(mode="after")
    def _file_needs_dir(self) -> TracingSettings:
        if self.exporter == "file" and not self.dir:
            raise ValueError("exporter=file needs a directory: set MESHSERVE_TRACING_DIR")
        return self


class _State:
    """What the hot path reads: one flag and the tracer (replaced by setup/reset only)."""

    enabled = False
    tracer: trace.Tracer = trace.NoOpTracer()
    provider: TracerProvider | None = None
    sample_ratio = 1.0
    trust_caller_sampling = False


def enabled() -> bool:
    return _State.enabled


def setup_tracing(
    service: str, settings: TracingSettings | None = None, *, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """Install tracing for this process as ``service``; None (and nothing installed) when it is off.

    ``exporter`` (tests) overrides the configured one and is flushed on every span end.
    Calling it again replaces the previous setup (the old provider is shut down).
    """
    settings = settings or load_settings(TracingSettings)  # type: ignore[type-var]
    if exporter is None and settings.exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"service.name": service, "service.instance.id": f"{service}-{os.getpid()}"})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif settings.exporter == "otlp":
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(settings)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(_json_exporter(service, settings)))
    reset_tracing()
    _State.provider = provider
    _State.tracer = provider.get_tracer("meshserve")
    _State.sample_ratio, _State.trust_caller_sampling = settings.sample_ratio, settings.trust_caller_sampling
    _State.enabled = True
    structlog.get_logger(__name__).info("tracing_enabled", exporter=settings.exporter if exporter is None else "test")
    return provider


def reset_tracing() -> None:
    """Turn tracing off again (flushes and shuts down the provider)."""
    provider = _State.provider
    _State.enabled, _State.tracer, _State.provider = False, trace.NoOpTracer(), None
    if provider is not None:
        provider.shutdown()


def _otlp_exporter(settings: TracingSettings) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        from services.common.errors import ConfigError

        raise ConfigError(
            "MESHSERVE_TRACING_EXPORTER=otlp needs the OTLP exporter: pip install 'meshserve[otlp]'"
        ) from exc
    return OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=settings.otlp_insecure)


def _json_exporter(service: str, settings: TracingSettings) -> SpanExporter:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    if settings.exporter == "console":
        return ConsoleSpanExporter(out=sys.stderr, formatter=span_json_line)

    class FileExporter(ConsoleSpanExporter):
        def shutdown(self) -> None:
            self.out.close()

    folder = Path(settings.dir)
    folder.mkdir(parents=True, exist_ok=True)
    out = (folder / f"{service}-{os.getpid()}.jsonl").open("a", encoding="utf-8")
    return FileExporter(out=out, formatter=span_json_line)


def span_json_line(span: ReadableSpan) -> str:
    """One finished span as a single JSON line (ids in hex, times in ns since the epoch)."""
    ctx = span.get_span_context()
    assert ctx is not None
    record: dict[str, Any] = {
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "trace_id": trace.format_trace_id(ctx.trace_id),
        "span_id": trace.format_span_id(ctx.span_id),
        "parent_span_id": trace.format_span_id(span.parent.span_id) if span.parent else "",
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }
    return json.dumps(record, separators=(",", ":")) + "\n"


# ---- hot path: every function returns at once when tracing is off ---------------------------------


class _Scope:
    """``start_as_current_span`` without its generator-based context manager (about 30 % cheaper)."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        otel_context.detach(self._token)
        if exc is not None:
            self._span.record_exception(exc)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self._span.end()


def span(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> contextlib.AbstractContextManager[Span]:
    """``with span("gateway.auth"):`` a child of the current span, current inside the block.

    An exception leaving the block marks the span failed (and is re-raised). Phases exist only
    inside a recorded request: outside any traced call, or in a trace the sampler left out, this is
    the shared no-op (an unsampled request costs one context lookup per phase, not a span).
    """
    if not _State.enabled or not trace.get_current_span().is_recording():
        return _NOOP_SCOPE
    return _Scope(_State.tracer.start_span(name, attributes=attributes))


def start_span(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> Span:
    """A child of the current span that the caller ends (for phases that span ``yield``s); see :func:`span`."""
    if not _State.enabled or not trace.get_current_span().is_recording():
        return INVALID_SPAN
    return _State.tracer.start_span(name, attributes=attributes)


def inject(carrier: dict[str, str]) -> None:
    """Add ``traceparent``/``tracestate`` of the current span to outgoing metadata."""
    if _State.enabled:
        _PROPAGATOR.inject(carrier)


def caller_trace_headers(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """A public caller's ``traceparent``/``tracestate`` fit to forward as gRPC metadata (HTTP adapter).

    A malformed ``traceparent`` is dropped (never an error), and ``tracestate`` goes only with a valid
    one; both must be short printable ASCII (anything else would fail the gRPC call).
    """
    parent = headers.get("traceparent", "").strip()
    if not parent or len(parent) > MAX_TRACE_HEADER_CHARS or not (parent.isascii() and parent.isprintable()):
        return ()
    if not trace.get_current_span(_PROPAGATOR.extract({"traceparent": parent})).get_span_context().is_valid:
        return ()
    forwarded = [("traceparent", parent)]
    state = headers.get("tracestate", "").strip()
    if state and len(state) <= MAX_TRACE_HEADER_CHARS and state.isascii() and state.isprintable():
        forwarded.append(("tracestate", state))
    return tuple(forwarded)


def _edge_decision(parent: otel_context.Context) -> otel_context.Context:
    """The caller's remote parent with our own sampling decision in place of its flag."""
    remote = trace.get_current_span(parent).get_span_context()
    if not remote.is_valid or _State.trust_caller_sampling:
        return parent
    sampled = random.random() < _State.sample_ratio  # sampling, not security
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    ours = SpanContext(remote.trace_id, remote.span_id, True, flags, remote.trace_state)
    return trace.set_span_in_context(NonRecordingSpan(ours), parent)


def start_server_span(name: str, metadata: Iterable[tuple[str, str | bytes]], *, public: bool = False) -> Span:
    """Start the SERVER span of an incoming call (parent from its metadata) and make it current.

    ``public`` (the edge callers reach): the caller's trace id and parent are kept, the sampling
    decision is ours (module docstring). The context stays attached for the rest of the calling task:
    gRPC runs every call in a task of its own, so it ends with the call (the same reason structlog's
    contextvars need no unbind).
    """
    carrier = {k: v for k, v in metadata if k in _SERVER_KEYS and isinstance(v, str)}
    parent = _PROPAGATOR.extract(carrier)
    if public:
        parent = _edge_decision(parent)
    attributes = {"rpc.system": "grpc"}
    for key, attribute in _CORRELATION.items():
        if carrier.get(key):
            attributes[attribute] = carrier[key]
    server = _State.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    otel_context.attach(trace.set_span_in_context(server, parent))
    ctx = server.get_span_context()
    if ctx.is_valid:
        structlog.contextvars.bind_contextvars(trace_id=trace.format_trace_id(ctx.trace_id))
    return server


def annotate(attributes: Mapping[str, AttributeValue]) -> None:
    """Set attributes on the current span (in a handler: the RPC's SERVER span)."""
    if _State.enabled:
        trace.get_current_span().set_attributes(attributes)


def record_error(target: Span, exc: BaseException, code: str) -> None:
    """Mark ``target`` failed with ``code`` (a gRPC status name), keeping the exception as an event."""
    target.set_attribute("rpc.grpc.status_code", code)
    if code != "CANCELLED":
        target.record_exception(exc)
        target.set_status(Status(StatusCode.ERROR, code))
