"""``meshserve bench soak --minutes N``: N minutes at 80 % of measured capacity; fail on resource growth.

1. Starts the local mesh (launcher of ``meshserve up``; rate limits set out of the way).
   Redis is started with ``--redis-maxmemory`` (32 MB; ``meshserve up`` uses 512 MB) so that the
   response and KV prefix caches reach their bound, and evict, during the warm-up; for the same reason
   the cloud workers' KV cache is ``--cloud-kv-budget-mib`` (128; the worker's default is 512). Its
   pages are zeroed on first touch (services/gpu_worker/model.py), so a cloud worker's RSS grows
   until the cached prefixes fill the budget: at 512 MiB that took longer than a 10-minute soak
   (+9.1 % RSS, 2026-12-03), a bounded fill that the verdict cannot tell from a leak.
2. **Capacity**: a short closed-loop ramp (``--ramp`` concurrencies, ``--ramp-seconds`` each) of the
   workload; capacity = the highest requests/s of a step without errors.
3. **Fill**: up to ``--fill`` distinct one-token prompts, with ``--fill-chat`` chat turns (longer
   prompts, with shared system-prompt prefixes) among them, at ``--fill-concurrency`` for at most
   ``--fill-seconds``: every connection pool (redis-py pools grow to the peak concurrency they have
   seen and keep their connections) sees more concurrency than the soak brings, and the caches that
   fill only with distinct prompts (the router's tokenizer LRU of 2,048 prompts, ~1.4 MB) get as
   full as the time allows (the report says how many).
4. **Soak**: Poisson arrivals at ``--load`` (0.8) times capacity for N minutes, in 30-s chunks, while a
   sampler reads every service process's RSS and open file descriptors (psutil), its fds by kind
   and Redis's INFO (used_memory, maxmemory, evicted_keys, clients) every ``--interval`` seconds.
5. **Verdict**: per process and measure, the median of a *baseline window* right after the warm-up
   (not the cold start) against the median of the *final window*; growth above ``--max-growth``
   (5 %) on any of them fails the run (exit 1). Errors by status are reported too, and the growth
   over the second half alone (window at mid-run vs final window), which tells a steady leak (still
   growing) from a high-water mark reached once (flat late).

Writes docs/benchmarks/soak.json and docs/soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import redis.asyncio as aioredis

from benchmarks import earlier_runs
from benchmarks.load import soak_probe, soak_report
from benchmarks.load.bench import UNLIMITED, parse_mix
from benchmarks.load.generator import (
    Result,
    WorkItem,
    Workload,
    closed_loop,
    make_items,
    open_loop,
    poisson_schedule,
    summarize,
)
from benchmarks.load.senders import grpc_sender
from services.cli.client import MeshClient
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig

Samples = dict[str, list[tuple[float, float]]]
"""``"<process>/<rss_mb|fds>"`` → (seconds since the soak started, value)."""

FILL_PROMPTS = 2500
"""Default ``--fill``: more distinct prompts than the router's tokenizer LRU holds (2,048), if time allows."""


def service_processes(named: dict[int, str]) -> dict[str, psutil.Process]:
    """This process's children (the mesh), named from ``named`` (pid → service) or their executable."""
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            out[named.get(child.pid) or child.name()] = child
        except psutil.NoSuchProcess:
            continue
    return out


def sample(procs: dict[str, psutil.Process], t: float, samples: Samples) -> None:
    for name, proc in procs.items():
        try:
            rss, fds = proc.memory_info().rss / 2**20, proc.num_fds()
        except psutil.NoSuchProcess:
            continue
        samples.setdefault(f"{name}/rss_mb", []).append((t, rss))
        samples.setdefault(f"{name}/fds", []).append((t, float(fds)))


def growth(series: list[tuple[float, float]], warmup_s: float, window_s: float) -> dict[str, float]:
    """Median of the window starting at ``warmup_s`` vs median of the last ``window_s``; growth in %."""
    if not series:
        raise ValueError("no samples")
    end = series[-1][0]
    base = [v for t, v in series if warmup_s <= t < warmup_s + window_s] or [series[0][1]]
    final = [v for t, v in series if t >= end - window_s] or [series[-1][1]]
    b, f = statistics.median(base), statistics.median(final)
    pct = (f - b) / b * 100 if b else (0.0 if f == b else float("inf"))
    return {"baseline": round(b, 2), "final": round(f, 2), "growth_pct": round(pct, 2)}


def verdict(samples: Samples, warmup_s: float, window_s: float, max_growth_pct: float) -> dict[str, Any]:
    """Growth of every series and the series that grew more than allowed."""
    rows = {key: growth(series, warmup_s, window_s) for key, series in sorted(samples.items())}
    for key, series in samples.items():  # a leak keeps growing; a high-water mark levels off
        rows[key]["second_half_growth_pct"] = growth(series, series[-1][0] / 2, window_s)["growth_pct"]
    failed = [key for key, row in rows.items() if row["growth_pct"] > max_growth_pct]
    return {"max_growth_pct": max_growth_pct, "series": rows, "grew": failed, "pass": not failed}


async def capacity(send: Any, workload: Workload, levels: Sequence[int], seconds: float) -> dict[str, Any]:
    """Closed-loop ramp; capacity = best requests/s of an error-free step."""
    steps: list[dict[str, Any]] = []
    for level in levels:
        items = make_items(workload, 10_000, random.Random(level), tag=f"ramp{level}-{time.time_ns()}-")
        results, wall = await closed_loop(send, items, level, seconds)
        steps.append({"concurrency": level, "summary": summarize(results, wall)})
        print(f"soak ramp: concurrency {level}: {steps[-1]['summary']['requests_per_s']:.2f} req/s", file=sys.stderr)
    clean = [s["summary"]["requests_per_s"] for s in steps if not s["summary"]["errors"]]
    return {"steps": steps, "requests_per_s": max(clean or [0.0])}


def fill_items(n: int, chats: int, rng: random.Random, tag: str) -> list[WorkItem]:
    """``n`` distinct short prompts and ``chats`` distinct chat turns, one token each; the chat turns come
    first, shuffled with as many short ones (both tiers at their peak at once, even in a short fill)."""
    short = make_items(Workload(1.0, 0.0, 0.0, max_tokens=1), n, rng, tag=tag)
    head = short[:chats] + make_items(Workload(0.0, 0.0, 1.0, max_tokens=1), chats, rng, tag=f"{tag}chat-")
    rng.shuffle(head)
    return head + short[chats:]


async def fill(send: Any, n: int, chats: int, concurrency: int, seconds: float, timeout_s: float) -> dict[str, Any]:
    """:func:`fill_items` in a closed loop for at most ``seconds``: peaks the pools, fills prompt-keyed caches."""
    if n + chats <= 0 or seconds <= 0:
        return {"requests": 0}
    items = fill_items(n, chats, random.Random(n), tag=f"fill-{time.time_ns()}-")
    results, wall = await closed_loop(send, items, concurrency, seconds, timeout_s=timeout_s)
    summary = summarize(results, wall)
    print(f"soak fill: {len(results)} requests in {wall:.0f} s, errors {summary['errors'] or 'none'}", file=sys.stderr)
    return {
        "requests": len(results),
        "chat": sum(r.kind == "chat" for r in results),
        "concurrency": concurrency,
        "wall_s": round(wall, 1),
        "errors": summary["errors"],
    }


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    mix = parse_mix(args.mix)
    workload = Workload(
        mix["short"], mix["long"], mix["chat"], cache_hit_ratio=args.cache_hit_ratio, max_tokens=args.max_tokens
    )
    config = MeshConfig(
        edge_workers=args.edge_workers, cloud_workers=args.cloud_workers, redis_maxmemory=args.redis_maxmemory
    )
    config.extra_env.update(UNLIMITED)
    config.extra_env["MESHSERVE_GPU_WORKER_KV_BUDGET_BYTES"] = str(args.cloud_kv_budget_mib << 20)
    print("soak: starting the mesh...", file=sys.stderr, flush=True)
    logs = soak_probe.LogCounter()
    async with Mesh(config, sink=logs) as mesh, MeshClient(mesh.gateway_address, DEV_API_KEY) as client:
        await client.wait_ready()
        send = grpc_sender(client, args.timeout)
        logs.phase = "ramp"
        cap = await capacity(send, workload, args.ramp, args.ramp_seconds)
        if cap["requests_per_s"] <= 0:
            raise SystemExit("soak: no ramp step finished without errors; the mesh cannot be soaked")
        rate = args.load * cap["requests_per_s"]
        logs.phase = "fill"
        filled = await fill(send, args.fill, args.fill_chat, args.fill_concurrency, args.fill_seconds, args.timeout)
        procs = service_processes({p.proc.pid: n for n, p in mesh.processes.items() if p.proc is not None})
        redis = aioredis.Redis.from_url(mesh.redis_url)
        samples: Samples = {}
        redis_samples: Samples = {}
        kinds: dict[str, list[tuple[float, dict[str, int]]]] = {}
        threads: Samples = {}
        clients: list[tuple[float, dict[str, int]]] = []  # Redis connections by owner, at start/baseline/end
        results: list[Result] = []
        logs.phase = "soak"
        t0 = time.perf_counter()
        total_s = args.minutes * 60

        async def sampler() -> None:
            while (t := time.perf_counter() - t0) < total_s + args.interval:
                sample(procs, t, samples)
                ports = soak_probe.port_owners(procs)
                for name, proc in procs.items():
                    kinds.setdefault(name, []).append((round(t, 1), soak_probe.fd_kinds(proc, ports)))
                    with contextlib.suppress(psutil.NoSuchProcess):  # not in the verdict: a clue for RSS
                        threads.setdefault(name, []).append((t, float(proc.num_threads())))
                for key, value in (await soak_probe.redis_stats(redis)).items():
                    redis_samples.setdefault(key, []).append((t, value))
                if not clients or t >= args.warmup_minutes * 60 > clients[-1][0]:  # start and baseline
                    clients.append((round(t, 1), soak_probe.redis_client_owners(await redis.client_list(), ports)))
                await asyncio.sleep(args.interval)

        task = asyncio.create_task(sampler())
        rng = random.Random(args.seed)
        chunk = 0
        while (elapsed := time.perf_counter() - t0) < total_s:
            span = min(30.0, total_s - elapsed)
            arrivals = poisson_schedule(rate, span, 100_000, rng)
            items = make_items(workload, len(arrivals), rng, tag=f"soak{chunk}-{time.time_ns()}-")
            got, _wall = await open_loop(send, items, arrivals, timeout_s=args.timeout)
            results += got
            chunk += 1
            print(
                f"soak: {elapsed / 60 + span / 60:.1f}/{args.minutes:g} min, {len(results)} requests, "
                f"{sum(r.status != 'OK' for r in results)} errors",
                file=sys.stderr,
                flush=True,
            )
        wall = time.perf_counter() - t0
        logs.phase = "stop"
        await task
        ports = soak_probe.port_owners(procs)
        clients.append(
            (round(time.perf_counter() - t0, 1), soak_probe.redis_client_owners(await redis.client_list(), ports))
        )
        await redis.aclose()
    warmup_s = args.warmup_minutes * 60
    window_s = args.window_minutes * 60
    return {
        "benchmark": "soak",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "command": " ".join(["meshserve bench soak", *args.argv]),
        "minutes": args.minutes,
        "workload": workload.__dict__,
        "capacity": cap,
        "fill": filled,
        "redis_maxmemory": args.redis_maxmemory,
        "cloud_kv_budget_bytes": args.cloud_kv_budget_mib << 20,
        "load_fraction": args.load,
        "rate_requests_per_s": round(rate, 3),
        "warmup_s": warmup_s,
        "window_s": window_s,
        "interval_s": args.interval,
        "summary": summarize(results, wall),
        "verdict": verdict(samples, warmup_s, window_s, args.max_growth),
        "redis": redis_summary(redis_samples, warmup_s),
        "redis_clients": clients,
        "log_events": logs.summary(),
        "fd_kinds": {name: fd_change(series, warmup_s) for name, series in kinds.items()},
        "threads": {name: growth(series, warmup_s, window_s) for name, series in threads.items()},
        "samples": {k: [(round(t, 1), round(v, 2)) for t, v in s] for k, s in samples.items()},
        "redis_samples": {k: [(round(t, 1), v) for t, v in s] for k, s in redis_samples.items()},
    }


def redis_summary(series: Samples, warmup_s: float, full_fraction: float = 0.95) -> dict[str, Any]:
    """Redis at the baseline (first sample from ``warmup_s``) and at the end, and when it filled.

    ``full_at_s``: first sample with used_memory >= ``full_fraction`` x maxmemory (None if never):
    before ``warmup_s``, Redis's memory in the baseline window is that of a full cache.
    """
    if not series.get("used_memory"):
        return {}
    times = [t for t, _ in series["used_memory"]]
    base_i = next((i for i, t in enumerate(times) if t >= warmup_s), 0)

    def at(i: int) -> dict[str, float]:
        return {k: s[i][1] for k, s in series.items() if len(s) > i}

    full_at = next(
        (
            t
            for (t, used), (_, cap) in zip(series["used_memory"], series["maxmemory"], strict=False)
            if cap and used >= full_fraction * cap
        ),
        None,
    )
    base, final = at(base_i), at(len(times) - 1)
    return {
        "baseline_t": round(times[base_i], 1),
        "baseline": base,
        "final": final,
        "full_at_s": None if full_at is None else round(full_at, 1),
        "full_before_baseline": full_at is not None and full_at <= warmup_s,
        "evicted_during_soak": final.get("evicted_keys", 0.0) - base.get("evicted_keys", 0.0),
    }


def fd_change(series: list[tuple[float, dict[str, int]]], warmup_s: float) -> dict[str, Any]:
    """fds by kind at the baseline (first sample from ``warmup_s``) and at the last sample."""
    base = next((s for s in series if s[0] >= warmup_s), series[0])
    return {"baseline_t": base[0], "baseline": base[1], "final_t": series[-1][0], "final": series[-1][1]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="soak length (default 10)")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity (default 0.8)")
    parser.add_argument("--ramp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--ramp-seconds", type=float, default=15.0, help="seconds per ramp step (default 15)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--warmup-minutes", type=float, default=None, help="before the baseline window (N/5)")
    parser.add_argument("--window-minutes", type=float, default=None, help="baseline and final window (N/10)")
    parser.add_argument(
        "--redis-maxmemory", default="32mb", help="maxmemory of the Redis the soak starts (default 32mb)"
    )
    parser.add_argument(
        "--cloud-kv-budget-mib", type=int, default=128, help="the cloud workers' KV cache in MiB (default 128)"
    )
    parser.add_argument(
        "--fill", type=int, default=FILL_PROMPTS, help=f"distinct prompts before the soak (default {FILL_PROMPTS})"
    )
    parser.add_argument("--fill-chat", type=int, default=48, help="chat turns in the fill (default 48)")
    parser.add_argument("--fill-seconds", type=float, default=120.0, help="longest fill (default 120 s)")
    parser.add_argument("--fill-concurrency", type=int, default=16, help="concurrency of the fill (default 16)")
    parser.add_argument("--max-growth", type=float, default=5.0, help="allowed growth in %% (default 5)")
    parser.add_argument("--mix", default="short=0.8,chat=0.2", help="request kinds (default short=0.8,chat=0.2)")
    parser.add_argument("--cache-hit-ratio", type=float, default=0.2, help="repeated greedy prompts (default 0.2)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    parser.add_argument("--edge-workers", type=int, default=2)
    parser.add_argument("--cloud-workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="JSON output directory")
    parser.add_argument("--doc", type=Path, default=Path("docs/soak.md"), help="Markdown report")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    args.warmup_minutes = args.minutes / 5 if args.warmup_minutes is None else args.warmup_minutes
    args.window_minutes = args.minutes / 10 if args.window_minutes is None else args.window_minutes
    if args.warmup_minutes + 2 * args.window_minutes > args.minutes:
        parser.error("--warmup-minutes plus two windows must fit in --minutes")
    report = asyncio.run(soak(args))
    report["json_path"] = str(args.out / "soak.json")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    earlier_runs.write(args.doc, soak_report.markdown(report))
    print(soak_report.markdown(report))
    return 0 if report["verdict"]["pass"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
