"""Router-only Prometheus metrics (latency histograms and token counters are in services.common.metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ROUTE_DECISIONS = Counter(
    "meshserve_route_decisions_total",
    "Routing decisions by chosen tier and reason (prompt_short, prompt_long, hint, spill, spill_saturated, "
    "fallback, cache_hit, collapsed).",
    ["tier", "reason"],
)
REPLICA_DECISIONS = Counter(
    "meshserve_router_replica_decisions_total",
    "Replica choices by tier and reason (prefix, ring, p2c, only).",
    ["tier", "reason"],
)
RETRIES = Counter(
    "meshserve_router_retries_total",
    "Requests retried on another replica after a worker failed before the first token, by status code.",
    ["tier", "code"],
)
FAILOVERS = Counter(
    "meshserve_router_failovers_total",
    "Streams resumed on another replica after tokens were sent (prompt + sent tokens prefilled).",
    ["tier", "code"],
)
RESUMES = Counter(
    "meshserve_router_resumes_total",
    "Where streams were resumed after their worker failed mid-stream: same_build (a replica of the failed "
    "worker's build had a slot), same_build_after_wait (it had one within resume_same_build_wait_s), "
    "cross_build_busy (every same-build replica stayed busy: resumed on another build or tier), "
    "cross_build_none (no healthy replica of that build).",
    ["tier", "outcome"],
)
COLLAPSED = Counter(
    "meshserve_router_collapsed_requests_total",
    "Requests served by joining an identical deterministic request already in flight.",
)
SHED = Counter(
    "meshserve_router_shed_requests_total",
    "Requests refused early (RESOURCE_EXHAUSTED) because the estimated TTFT exceeded the tenant's SLO.",
    ["tier", "priority"],
)
EJECTIONS = Counter(
    "meshserve_router_ejections_total",
    "Replicas ejected from routing after errors or stalls.",
    ["tier", "reason"],
)
QUEUE_TIME = Histogram(
    "meshserve_router_queue_time_seconds",
    "Time a request waited in the router for a free slot of its tier.",
    ["tier"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
VERSION_REQUESTS = Counter(
    "meshserve_router_model_requests_total",
    "Requests and chat turns by model, version (build), role (primary or shadow) and final status.",
    ["model", "version", "role", "status"],
)
VERSION_TTFT = Histogram(
    "meshserve_router_model_ttft_seconds",
    "Time to the first token by model, version and role (primary: the caller's; shadow: the discarded copy's).",
    ["model", "version", "role"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SHADOW = Counter(
    "meshserve_router_shadow_requests_total",
    "Shadow copies by model, version and outcome (agreed, differed: greedy text vs the primary's; "
    "not_compared: sampled; failed; shed: too many shadows in flight).",
    ["model", "version", "outcome"],
)
ROLLBACKS = Counter(
    "meshserve_router_rollbacks_total",
    "Rollouts rolled back, by model, the version rolled back and trigger (manual, auto).",
    ["model", "version", "trigger"],
)
ROLLOUT_STORE_UP = Gauge(
    "meshserve_router_rollout_store_up",
    "1 while the shared rollout store (Redis) answers; 0: this router keeps its last known policies (or shares "
    "none: no models file or no Redis).",
)
ROLLOUT_EPOCH = Gauge(
    "meshserve_router_rollout_policy_epoch",
    "Epoch of the rollout policy in force per model (0: the models file's); equal on every router replica once "
    "a change has spread.",
    ["model"],
)
HELD = Gauge(
    "meshserve_router_held_requests",
    "Requests held now, waiting for a replica of their model version to wake up or to start (scale from zero: "
    "the local scaler and KEDA start a worker on it).",
    ["model", "version"],
)
WAKES = Counter(
    "meshserve_router_wakes_total",
    "Wakes of a sleeping replica started for held requests, by outcome (ok; failed: the load failed; no_memory: "
    "the host was short of memory; abandoned: every held request went away first and the wake was cancelled).",
    ["model", "version", "outcome"],
)
WAKE_SECONDS = Histogram(
    "meshserve_router_wake_seconds",
    "Time from the router's Wake call to the replica answering awake.",
    ["model", "version"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120),
)
HELD_TIMEOUTS = Counter(
    "meshserve_router_held_timeouts_total",
    "Held requests answered UNAVAILABLE because no replica of their version was awake within the wake deadline.",
    ["model", "version"],
)
MODEL_REPLICAS = Gauge(
    "meshserve_router_model_replicas",
    "Replicas of a model version the router knows, by model state (awake, waking, asleep; falling asleep counts "
    "as asleep).",
    ["model", "version", "state"],
)
IDLE_SECONDS = Gauge(
    "meshserve_router_idle_seconds",
    "Seconds since the model version's last request (or since the router started); the stop policy of "
    "`meshserve up` and KEDA's scale to zero read it.",
    ["model", "version"],
)
