"""Router-only Prometheus metrics (latency histograms and token counters are in services.common.metrics)."""

from __future__ import annotations

from prometheus_client import Counter

ROUTE_DECISIONS = Counter(
    "meshserve_route_decisions_total",
    "Routing decisions by chosen tier and reason (prompt_short, prompt_long, hint, spill, fallback, cache_hit).",
    ["tier", "reason"],
)
RETRIES = Counter(
    "meshserve_router_retries_total",
    "Requests retried on another replica after a worker failed before the first token, by status code.",
    ["tier", "code"],
)
