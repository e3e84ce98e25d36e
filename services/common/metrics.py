"""Prometheus metrics shared by every service, and the /metrics HTTP endpoint.

Names follow the OpenTelemetry GenAI conventions where one exists:
``gen_ai.server.time_to_first_token`` -> ``meshserve_time_to_first_token_seconds``,
``gen_ai.server.time_per_output_token`` -> ``meshserve_time_per_output_token_seconds``,
``gen_ai.server.request.duration`` -> ``meshserve_request_duration_seconds``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)

TTFT = Histogram(
    "meshserve_time_to_first_token_seconds",
    "Time from request arrival at this service to the first token sent back.",
    ["service", "tier"],
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN = Histogram(
    "meshserve_time_per_output_token_seconds",
    "Time between consecutive output tokens of one stream (inter-token latency).",
    ["service", "tier"],
    buckets=_TOKEN_BUCKETS,
)
REQUEST_DURATION = Histogram(
    "meshserve_request_duration_seconds",
    "End-to-end duration of a request at this service, by final gRPC status.",
    ["service", "tier", "status"],
    buckets=_LATENCY_BUCKETS,
)
TOKENS = Counter(
    "meshserve_tokens_total",
    "Tokens processed, by direction (input = prompt, output = generated).",
    ["service", "tier", "direction"],
)
QUEUE_DEPTH = Gauge(
    "meshserve_queue_depth",
    "Requests waiting for a generation slot (worker: its admission queue; router: the tier's fair queue).",
    ["service", "tier"],
)
BATCH_SIZE = Gauge(
    "meshserve_batch_size",
    "Sequences generating at once (worker: its running batch; router: turns in flight to the tier).",
    ["service", "tier"],
)


def track_load(service: str, tier: str, *, queued: Callable[[], int], active: Callable[[], int]) -> None:
    """Export ``queued()`` and ``active()`` as the queue-depth and batch-size gauges, read at scrape time.

    Scrapes run on the metrics server's thread while the event loop mutates the queues; a read that
    races a mutation (``RuntimeError`` from a changing deque) is retried.
    """
    QUEUE_DEPTH.labels(service, tier).set_function(_retrying(queued))
    BATCH_SIZE.labels(service, tier).set_function(_retrying(active))


def _retrying(read: Callable[[], int]) -> Callable[[], float]:
    def value() -> float:
        for _ in range(3):
            try:
                return float(read())
            except RuntimeError:
                continue
        return float(read())

    return value


def start_metrics_server(port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> int | None:
    """Serve /metrics on ``host:port`` in a daemon thread; returns the bound port (None if port < 0)."""
    if port < 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
