"""`meshserve status`: a live terminal view of the mesh.

What it shows, and where each figure comes from:

- replicas per tier with health, in-flight turns and ejections: the router's replica view
  (``RouterAdmin.ListReplicas``, internal credential);
- with several models or versions, each model's rollout (weights, primary, stickiness, shadow,
  automatic rollback) and per-version counters (``RouterAdmin.ListRollouts``);
- load (active / slots), queue, tokens generated and tokens/s per replica, its model's state (awake,
  asleep, waking, falling asleep: scale from zero, docs/deploy.md) and its resident memory: each
  worker's own ``Worker.Stats``, read when the frame is taken. A worker ``meshserve up``'s scaler
  stopped while idle is listed too, as ``stopped`` (from the state file). The router's copies of
  load and queue come from the workers' heartbeats (``heartbeat_interval_s``, 1 s by default), so
  they are shown only for a worker that does not answer. tokens/s is the change of the token count
  between two frames over the time between them; the first frame (and ``--once``) shows the
  worker's own rate, a 5 s trailing average, which a burst reaches only after 5 s and leaves only 5 s
  after it ended;
- response and KV cache hit ratios and entries: the cache service's ``Cache.Stats`` (optional);
- requests, rate-limit rejections, load shedding and errors: the services' Prometheus ``/metrics``
  (optional; ``--metrics name=url``);
- restarts of the services ``meshserve up`` supervises (state, restart count, last exit reason such as
  ``killed by SIGKILL`` or ``exit code 1``, crash loops): its state file, which it rewrites whenever a
  service exits or comes back (services/local/supervise.py). Shown only for the mesh of that file;
- the mesh's two Redis roles, the cache Redis and the state Redis (keys, files, batches, stored
  responses; its append-only file's directory), or one Redis for both: the same state file.

Addresses default to those ``meshserve up`` records in its state file (:func:`state_path`), so
``meshserve status`` alone watches the local mesh. ``--once`` prints one frame and exits; ``--json``
prints one frame as JSON (the same figures) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from services.cli.rollout import describe
from services.common import metadata as md
from services.common import model_state_pb
from services.common.config import DEFAULT_INTERNAL_TOKEN, ClientSettings
from services.common.model_state import ModelState
from services.common.pb.meshserve.internal.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    router_admin_pb2,
    router_admin_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.pb.meshserve.v1 import inference_pb2
from services.local.state import read_state, state_path

_TIERS = {inference_pb2.TIER_EDGE: "edge", inference_pb2.TIER_CLOUD: "cloud"}
_MODEL_STATES = {
    ModelState.AWAKE: "awake",
    ModelState.ASLEEP: "asleep",
    ModelState.WAKING: "waking",
    ModelState.FALLING_ASLEEP: "falling asleep",
}
STOPPED = "stopped"
"""The model state of a worker process ``meshserve up`` stopped on purpose (its scaler, while idle)."""
_CACHE_KINDS = {cache_pb2.CACHE_KIND_RESPONSE: "response", cache_pb2.CACHE_KIND_KV: "kv prefix"}
# Prometheus counters summed into the traffic line: label -> (metric name, label filter).
_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "rate limited": ("meshserve_rate_limit_rejections_total", {}),
    "shed (TTFT SLO)": ("meshserve_router_shed_requests_total", {}),
    "retries": ("meshserve_router_retries_total", {}),
    "failovers": ("meshserve_router_failovers_total", {}),
}


@dataclass
class ReplicaView:
    """One worker replica as ``meshserve status`` shows it."""

    tier: str
    name: str
    address: str
    healthy: bool
    active: int
    queued: int
    max_active: int
    in_flight: int
    ejections: int
    self_registered: bool
    tokens_per_s: float | None = None
    tokens_total: int | None = None
    stats_at: float | None = None
    """``time.monotonic()`` when the worker's own Stats answered (None: the router's view only)."""
    model_state: str | None = None
    """awake, asleep, waking, falling asleep (its Stats), ``stopped`` (its process, by the scaler); None: unknown."""
    resident_bytes: int | None = None
    """The worker process's resident memory (its Stats); None: unknown."""


@dataclass
class MeshView:
    """One frame: everything gathered at ``taken_at``; ``problems`` lists what could not be read."""

    router: str
    router_serving: bool = False
    replicas: list[ReplicaView] = field(default_factory=list)
    cache: dict[str, tuple[float, int, int, int]] = field(default_factory=dict)
    """kind -> (hit ratio, hits, misses, entries)."""
    requests: dict[str, int] = field(default_factory=dict)
    """Gateway requests by final status."""
    counters: dict[str, int] = field(default_factory=dict)
    metrics_read: bool = False
    """At least one metrics endpoint answered (the traffic line is shown, zeros included)."""
    problems: list[str] = field(default_factory=list)
    rollouts: list[router_admin_pb2.ModelRollout] = field(default_factory=list)
    """The router's served models and their rollouts (shown when it serves more than one version)."""
    services: dict[str, dict[str, object]] = field(default_factory=dict)
    """Supervised services of ``meshserve up`` (its state file): name -> state, restarts, last_exit, ..."""
    redis: dict[str, str] = field(default_factory=dict)
    """The mesh's Redis by role (its state file): ``cache`` and ``state`` -> what the line shows."""
    taken_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))


async def _replicas(channel: grpc.aio.Channel, meta: tuple[tuple[str, str], ...], view: MeshView) -> None:
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    view.router_serving = health.status == health_pb2.HealthCheckResponse.SERVING
    reply = await router_admin_pb2_grpc.RouterAdminStub(channel).ListReplicas(
        router_admin_pb2.ListReplicasRequest(), metadata=meta, timeout=2.0
    )
    for r in reply.replicas:
        view.replicas.append(
            ReplicaView(
                tier=_TIERS.get(r.tier, "?"),
                name=r.worker_id or r.address,
                address=r.address,
                healthy=r.healthy,
                active=r.active_sequences,
                queued=r.queue_depth,
                max_active=r.max_active_sequences,
                in_flight=r.in_flight,
                ejections=r.ejections,
                self_registered=r.self_registered,
            )
        )
    try:
        rollouts = await router_admin_pb2_grpc.RouterAdminStub(channel).ListRollouts(
            router_admin_pb2.ListRolloutsRequest(), metadata=meta, timeout=2.0
        )
        view.rollouts = list(rollouts.models)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # a router from before model versions: none to show
            raise


async def _worker_stats(replica: ReplicaView, meta: tuple[tuple[str, str], ...]) -> None:
    try:
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stats = await worker_pb2_grpc.WorkerStub(channel).Stats(
                worker_pb2.StatsRequest(), metadata=meta, timeout=1.0
            )
    except grpc.aio.AioRpcError:
        return  # shown as "-": the router's health column already says why
    replica.stats_at = time.monotonic()
    replica.active = stats.active_sequences  # the worker's own, not the router's last heartbeat copy
    replica.queued = stats.queue_depth
    replica.max_active = stats.max_active_sequences
    replica.tokens_per_s = stats.recent_tokens_per_second
    replica.tokens_total = stats.tokens_generated_total
    state = model_state_pb.from_pb(stats.model_state)
    replica.model_state = "?" if state is None else _MODEL_STATES[state]
    replica.resident_bytes = stats.resident_bytes or None


def add_stopped(view: MeshView) -> None:
    """List the workers ``meshserve up`` stopped on purpose (state ``stopped (idle)`` in its state file):
    they have left the router's view, but are replicas of the mesh that a held request starts again."""
    listed = {r.name for r in view.replicas}
    for name, record in view.services.items():
        tier = name.split("-", 1)[0]
        if tier in ("edge", "cloud") and str(record.get("state", "")).startswith(STOPPED) and name not in listed:
            view.replicas.append(
                ReplicaView(tier, name, "-", False, 0, 0, 0, 0, 0, False, model_state=STOPPED, resident_bytes=0)
            )


def _rates_since(view: MeshView, previous: MeshView | None) -> None:
    """tokens/s of each replica as its token count's change since ``previous`` (the last frame)."""
    if previous is None:
        return
    before = {r.address: r for r in previous.replicas if r.stats_at is not None and r.tokens_total is not None}
    for replica in view.replicas:
        old = before.get(replica.address)
        if old is None or replica.stats_at is None or replica.tokens_total is None:
            continue
        elapsed = replica.stats_at - (old.stats_at or 0.0)
        added = replica.tokens_total - (old.tokens_total or 0)
        if elapsed > 0 and added >= 0:  # a restarted worker counts from 0 again: keep its own rate
            replica.tokens_per_s = added / elapsed


async def _cache(address: str, meta: tuple[tuple[str, str], ...], view: MeshView) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await cache_pb2_grpc.CacheStub(channel).Stats(cache_pb2.CacheStatsRequest(), metadata=meta, timeout=5.0)
    for k in reply.kinds:
        view.cache[_CACHE_KINDS.get(k.kind, "?")] = (k.hit_ratio, k.hits, k.misses, k.entries)


def _add_metrics(name: str, text: str, view: MeshView) -> None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshserve_request_duration_seconds_count" and sample.labels.get("service") == "gateway":
                status = sample.labels.get("status", "?")
                view.requests[status] = view.requests.get(status, 0) + int(sample.value)
            for label, (metric, where) in _COUNTERS.items():
                if sample.name == metric and all(sample.labels.get(k) == v for k, v in where.items()):
                    view.counters[label] = view.counters.get(label, 0) + int(sample.value)


async def gather(
    router: str,
    *,
    cache: str = "",
    metrics: dict[str, str] | None = None,
    token: str = DEFAULT_INTERNAL_TOKEN,
    previous: MeshView | None = None,
) -> MeshView:
    """Read one frame (``previous``: the last one, for tokens/s over the time between them). Never
    raises for an unreachable part: it is listed in ``problems`` instead."""
    view = MeshView(router=router)
    meta = ((md.INTERNAL_TOKEN, token),)
    try:
        async with grpc.aio.insecure_channel(router) as channel:
            await _replicas(channel, meta, view)
    except grpc.aio.AioRpcError as exc:
        view.problems.append(f"router {router}: {exc.code().name} ({exc.details()})")
    await asyncio.gather(*(_worker_stats(r, meta) for r in view.replicas))
    _rates_since(view, previous)
    if cache:
        try:
            await _cache(cache, meta, view)
        except grpc.aio.AioRpcError as exc:
            view.problems.append(f"cache {cache}: {exc.code().name} ({exc.details()})")
    if metrics:
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for name, url in metrics.items():
                try:
                    async with session.get(url) as response:
                        _add_metrics(name, await response.text(), view)
                    view.metrics_read = True
                except (aiohttp.ClientError, TimeoutError) as exc:
                    view.problems.append(f"metrics {name} {url}: {type(exc).__name__}")
    return view


def render(view: MeshView) -> Group:
    """The frame as rich renderables: header, replicas by tier, caches, traffic, problems."""
    state = Text("SERVING", style="green") if view.router_serving else Text("NOT SERVING", style="red")
    header = Text.assemble(
        ("meshserve status", "bold"), f"  router {view.router} ", state, f"  {view.taken_at:%H:%M:%S} UTC"
    )
    parts: list[object] = [header]
    for tier in ("edge", "cloud"):
        rows = [r for r in view.replicas if r.tier == tier]
        if not rows:
            parts.append(Text(f"{tier}: no replicas"))
            continue
        up = sum(r.healthy for r in rows)
        rate = sum(r.tokens_per_s or 0.0 for r in rows)
        table = Table(title=f"{tier}: {up}/{len(rows)} replicas healthy, {rate:.1f} tokens/s", title_justify="left")
        for column in (
            "replica",
            "address",
            "health",
            "load",
            "queued",
            "in flight",
            "tokens/s",
            "tokens",
            "ejections",
            "model",
            "memory",
        ):
            table.add_column(column, justify="left" if column in ("replica", "address", "health", "model") else "right")
        for r in rows:
            table.add_row(
                r.name + (" (registered)" if r.self_registered else ""),
                r.address,
                _health(r),
                f"{r.active}/{r.max_active}",
                str(r.queued),
                str(r.in_flight),
                "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}",
                "-" if r.tokens_total is None else str(r.tokens_total),
                str(r.ejections),
                Text(r.model_state or "-", style=_MODEL_STYLES.get(r.model_state or "", "")),
                _mib(r.resident_bytes),
            )
        parts.append(table)
    if len(view.rollouts) > 1 or any(len(m.versions) > 1 for m in view.rollouts):
        parts.append(Text("models:\n" + "\n".join(describe(m) for m in view.rollouts)))
    if view.cache:
        caches = Table(title="caches", title_justify="left")
        for column in ("cache", "hit ratio", "hits", "misses", "entries"):
            caches.add_column(column, justify="left" if column == "cache" else "right")
        for kind, (ratio, hits, misses, entries) in view.cache.items():
            caches.add_row(kind, f"{ratio:.1%}", str(hits), str(misses), str(entries))
        parts.append(caches)
    if view.requests or view.counters or view.metrics_read:
        total = sum(view.requests.values())
        errors = sum(n for status, n in view.requests.items() if status != "OK")
        figures = [f"requests {total}", f"errors {errors}"] + [f"{k} {v}" for k, v in view.counters.items()]
        figures += [f"{status} {n}" for status, n in sorted(view.requests.items()) if status != "OK"]
        parts.append(Text("traffic: " + " · ".join(figures)))
    if view.redis:
        parts.append(Text("redis: " + " · ".join(f"{role} {what}" for role, what in view.redis.items())))
    if view.services:
        parts.append(_services_table(view.services))
    for problem in view.problems:
        parts.append(Text(f"unreachable: {problem}", style="yellow"))
    return Group(*parts)  # type: ignore[arg-type]


_STATE_STYLES = {"running": "green", "restarting": "yellow", "crash loop": "bold red", "starting": "yellow"}
_MODEL_STYLES = {"awake": "green", "waking": "yellow", "falling asleep": "yellow", "asleep": "blue", STOPPED: "dim"}


def _health(replica: ReplicaView) -> Text:
    if replica.model_state == STOPPED:
        return Text(STOPPED, style="dim")
    return Text("up", style="green") if replica.healthy else Text("down", style="red")


def _mib(size: int | None) -> str:
    if size is None:
        return "-"
    return f"{size / 2**20:.0f} MiB"


def as_json(view: MeshView) -> dict[str, object]:
    """The frame as JSON-ready data: the figures the text shows (replicas with their model state and
    resident memory, caches, traffic, supervised services, Redis roles, problems)."""
    return {
        "router": view.router,
        "router_serving": view.router_serving,
        "taken_at": view.taken_at.isoformat(timespec="seconds"),
        "replicas": [{k: v for k, v in dataclasses.asdict(r).items() if k != "stats_at"} for r in view.replicas],
        "cache": {
            kind: {"hit_ratio": ratio, "hits": hits, "misses": misses, "entries": entries}
            for kind, (ratio, hits, misses, entries) in view.cache.items()
        },
        "requests": view.requests,
        "counters": view.counters,
        "services": view.services,
        "redis": view.redis,
        "problems": view.problems,
    }


def _services_table(services: dict[str, dict[str, object]]) -> Table:
    restarted = sum(1 for record in services.values() if record.get("restarts"))
    table = Table(title=f"services: {len(services)} supervised, {restarted} restarted", title_justify="left")
    for column in ("service", "state", "restarts", "last exit", "at (UTC)"):
        table.add_column(column, justify="right" if column == "restarts" else "left")
    for name, record in services.items():
        state = str(record.get("state", "?"))
        at = str(record.get("last_exit_at") or "")
        table.add_row(
            name,
            Text(state, style=_STATE_STYLES.get(state, "")),
            str(record.get("restarts", 0)),
            str(record.get("last_exit") or "-"),
            at[11:19] if len(at) >= 19 else at or "-",
        )
    return table


def redis_roles(state: Mapping[str, object]) -> dict[str, str]:
    """``cache`` and ``state`` -> the URL (with the password hidden) of each Redis role ``meshserve up``
    recorded, the state Redis's data directory with it; one ``cache+state`` entry when one Redis holds both."""
    cache, durable = str(state.get("redis") or ""), str(state.get("state_redis") or "")
    if not cache:
        return {}
    if not durable or durable == cache:
        return {"cache+state": _hide_password(cache)}
    directory = state.get("state_dir")
    return {
        "cache": _hide_password(cache),
        "state": _hide_password(durable) + (f" (append-only file in {directory})" if directory else ""),
    }


def _hide_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    return f"{scheme}{sep}***@{host}" if sep and at and userinfo else url


def _supervised(state: dict[str, object]) -> dict[str, dict[str, object]]:
    recorded = state.get("services", {})
    if not isinstance(recorded, dict):
        return {}
    return {str(k): v for k, v in recorded.items() if isinstance(v, dict)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshserve status", description="Live terminal view of the mesh.")
    p.add_argument("--router", default="", help="router host:port (default: from `meshserve up`'s state file)")
    p.add_argument("--cache", default=None, help="cache service host:port (default: from the state file)")
    p.add_argument(
        "--metrics",
        nargs="*",
        default=None,
        metavar="NAME=URL",
        help="Prometheus endpoints to read traffic counters from (default: from the state file)",
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="print one frame as JSON and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default 1)")
    p.add_argument(
        "--internal-token",
        default=ClientSettings().internal_token,
        help="the mesh's internal credential (default: $MESHSERVE_INTERNAL_TOKEN or the dev token)",
    )
    return p


def _targets(args: argparse.Namespace) -> tuple[str, str, dict[str, str]]:
    state: dict[str, object] = {}
    if not args.router or args.cache is None or args.metrics is None:
        state = read_state()
    router = args.router or str(state.get("router", ""))
    if not router:
        raise SystemExit(
            f"meshserve status: no router address; pass --router host:port or start `meshserve up` ({state_path()})"
        )
    cache = args.cache if args.cache is not None else str(state.get("cache", ""))
    if args.metrics is not None:
        metrics = dict(item.split("=", 1) for item in args.metrics if "=" in item)
    else:
        recorded = state.get("metrics", {})
        metrics = {str(k): str(v) for k, v in recorded.items()} if isinstance(recorded, dict) else {}
    return router, cache, metrics


async def _run(args: argparse.Namespace) -> int:
    router, cache, metrics = _targets(args)
    from_state = not args.router  # watching the mesh of the state file: its restarts are shown too

    last: MeshView | None = None

    async def frame() -> Group:
        nonlocal last, metrics
        state = read_state() if from_state else {}
        recorded = state.get("metrics")  # a restarted service serves /metrics on a new port
        if args.metrics is None and isinstance(recorded, dict):
            metrics = {str(k): str(v) for k, v in recorded.items()}
        last = await gather(router, cache=cache, metrics=metrics, token=args.internal_token, previous=last)
        last.services = _supervised(state)
        last.redis = redis_roles(state)
        add_stopped(last)
        return render(last)

    if args.json:
        await frame()
        assert last is not None
        print(json.dumps(as_json(last), indent=2))
        return 0
    if args.once:
        console = Console(width=None if sys.stdout.isatty() else 140)
        console.print(await frame())
        return 0
    with Live(await frame(), auto_refresh=False, screen=False) as live:
        while True:
            await asyncio.sleep(args.interval)
            live.update(await frame(), refresh=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0
