"""What tracing costs per request: the tracing calls of one request, off and on.

``python -m benchmarks.gateway.tracing`` replays, in a loop, exactly the tracing calls one request makes
across the mesh — 3 SERVER spans (gateway, router, worker; started from the caller's traceparent when
on), 2 context injections into outgoing metadata, and the 9 phase spans (auth, rate limit, tokenize,
cache lookup, route decision, queue wait, prefill, first token, stream end) with their attributes — and
measures it against an empty loop in these modes, interleaved round by round:

- ``off``: the default. No interceptor is installed, so no SERVER span; the rest are the no-op paths.
- ``otlp``: the production setup, batching to an OTLP/gRPC collector (a sink served in this process);
  also with ``sample_ratio=0.1`` (9 in 10 traces are decided unsampled at the gateway and cost less).
- ``file``: JSON lines written as each span ends (the debugging exporter).

Reported: wall time and CPU time of the calling thread per request (the latency the request path
pays), medians over rounds, minus the empty loop; and process CPU per request for ``otlp`` (adds the
batch exporter's thread and the in-process sink). Writes docs/benchmarks/tracing.json and .md.
"""

from __future__ import annotations

import argparse
import contextvars
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.common import tracing
from services.common.tracing import TracingSettings


class _Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def one_request() -> None:
    """The tracing calls of one request through gateway -> router -> worker (see the module doc)."""
    on = tracing.enabled()
    carrier: dict[str, str] = {}
    gateway = tracing.start_server_span("meshserve.v1.Inference/Generate", ()) if on else None
    with tracing.span("gateway.auth"):
        pass
    with tracing.span("gateway.rate_limit"):
        pass
    tracing.inject(carrier)
    router = tracing.start_server_span("meshserve.v1.Inference/Generate", carrier.items()) if on else None
    with tracing.span("router.tokenize"):
        pass
    with tracing.span("router.cache_lookup") as lookup:
        lookup.set_attribute("meshserve.cache.hit", False)
    with tracing.span("router.route_decision") as decision:
        decision.set_attributes({"meshserve.tier": "edge", "meshserve.worker": "edge-0"})
    tracing.inject(carrier)
    worker = tracing.start_server_span("meshserve.internal.v1.Worker/Generate", carrier.items()) if on else None
    with tracing.span("worker.queue_wait"):
        pass
    phase = tracing.start_span("worker.prefill")
    phase.end()
    phase = tracing.start_span("worker.first_token")
    phase.end()
    phase = tracing.start_span("worker.stream_end")
    phase.set_attributes({"meshserve.completion_tokens": 32})
    phase.end()
    for server in (worker, router, gateway):
        if server is not None:
            server.end()


def _empty() -> None:
    pass


def _reference() -> None:
    """A fixed amount of plain Python work, to judge how fast this machine ran at the time."""
    sum(range(1000))


def _measure(fn: Callable[[], None], n: int) -> tuple[float, float, float]:
    """(wall ns, thread CPU ns, process CPU ns) per call; each call in a fresh context, as a gRPC task."""
    contexts = [contextvars.Context() for _ in range(n)]
    w0, t0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
    for ctx in contexts:
        ctx.run(fn)
    w1, t1, p1 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
    return (w1 - w0) / n, (t1 - t0) / n, (p1 - p0) / n


def run(rounds: int, n: int) -> dict[str, object]:
    # A round ends thousands of spans in a burst; the batch queue's default (2048) would drop most of
    # them, making otlp look cheaper than it is. Large enough to export every span:
    os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", str(40 * n))
    sink = _Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    spans_dir = tempfile.TemporaryDirectory(prefix="meshserve-trace-bench-")
    modes = {
        "off": TracingSettings(),
        "otlp": TracingSettings(exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{port}"),
        "otlp, 10 % sampled": TracingSettings(
            exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{port}", sample_ratio=0.1
        ),
        "file": TracingSettings(exporter="file", dir=spans_dir.name),
    }
    samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in ("empty", *modes)}
    try:
        for _ in range(rounds):
            samples["empty"].append(_measure(_empty, n))
            for mode, settings in modes.items():
                tracing.setup_tracing("bench", settings)
                try:
                    samples[mode].append(_measure(one_request, n))
                finally:
                    tracing.reset_tracing()  # flushes (otlp: the batch goes to the sink)
    finally:
        server.stop(None)
        spans_dir.cleanup()
    results: dict[str, dict[str, float]] = {}
    for stat in (statistics.median, min):  # min: the round least disturbed by other load
        base = [stat(col) for col in zip(*samples["empty"], strict=True)]
        for mode in modes:
            wall, thread, proc = (stat(col) for col in zip(*samples[mode], strict=True))
            results.setdefault(mode, {}).update(
                {
                    f"wall_us_{stat.__name__}": round((wall - base[0]) / 1000, 3),
                    f"thread_cpu_us_{stat.__name__}": round((thread - base[1]) / 1000, 3),
                    f"process_cpu_us_{stat.__name__}": round((proc - base[2]) / 1000, 3),
                }
            )
    reference = min(_measure(_reference, n)[1] for _ in range(rounds)) / 1000
    return {
        "benchmark": "tracing",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "rounds": rounds,
        "requests_per_round": n,
        "spans_per_request": 12,
        "spans_received_by_otlp_sink": sink.spans,
        "reference_us": round(reference, 3),
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "results": results,
    }


def markdown(report: dict[str, object]) -> str:
    results = report["results"]
    assert isinstance(results, dict)
    lines = [
        "# Tracing overhead per request",
        "",
        f"{report['date']}, {report['machine']}; {report['rounds']} interleaved rounds of "
        f"{report['requests_per_round']} requests (medians, empty loop subtracted). "
        "`python -m benchmarks.gateway.tracing`.",
        "",
        "One request = the tracing calls of gateway + router + worker together: 3 SERVER spans (on only),",
        "2 traceparent injections, 9 phase spans. *Thread* = the request path (wall and CPU of the calling",
        "thread); *process CPU* adds the exporter's background thread (and, for otlp, the in-process sink).",
        "",
        f"Machine speed at the time: `sum(range(1000))` took {report['reference_us']} µs of CPU; "
        f"load average {report['load_average']}.",
        "",
        "| mode | thread CPU µs/request (median / min) | wall µs/request (median / min) | process CPU µs/request |",
        "|---|---|---|---|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {r['thread_cpu_us_median']:.2f} / {r['thread_cpu_us_min']:.2f} | "
            f"{r['wall_us_median']:.2f} / {r['wall_us_min']:.2f} | {r['process_cpu_us_median']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway.tracing", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--requests", type=int, default=3000, help="requests per round and mode (default 3000)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    report = run(args.rounds, args.requests)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tracing.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out / "tracing.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
