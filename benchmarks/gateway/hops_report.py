"""Markdown and JSON of :mod:`benchmarks.gateway.hops` reports (tables, CPU by process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import earlier_runs


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Hop overhead: gateway + router over a direct worker call, model compute removed",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs (shared with other work"
        + (
            f"; 1-min load average {report['machine']['load_avg_1m']:.1f} at the end"
            if "load_avg_1m" in report["machine"]
            else ""
        )
        + "), "
        f"Python {report['machine']['python']} · `{report['command']}`",
        "",
        "Real redis-server, real worker runtime (synthetic engine: tokens at once), real router and gateway",
        f"(API key check, rate-limit admission + stream lease in Redis), separate processes. Greedy requests of "
        f"{report['max_tokens']} tokens, response cache bypassed, the paths interleaved request by request "
        "(each round in a new seeded order).",
        "",
        "## Latency (ms); added = path minus direct worker",
        "",
        "| path | TTFT p50 | TTFT p99 | total p50 | total p99 | added TTFT p50 | added TTFT p99 | added total p50 "
        "| added total p99 | relay µs/frame |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["latency"].items():
        added = (
            f"{r['added_ttft_p50_ms']:+.2f} | {r['added_ttft_p99_ms']:+.2f} | {r['added_total_p50_ms']:+.2f} | "
            f"{r['added_total_p99_ms']:+.2f} | {r['relay_us_per_frame']:.0f}"
            if "added_ttft_p50_ms" in r
            else " | | | | "
        )
        lines.append(
            f"| {name} | {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} | {r['total_p50_ms']:.2f} | "
            f"{r['total_p99_ms']:.2f} | {added} |"
        )
    lines += _paired_table(report)
    lines += _targets(report)
    lines += _cpu_table(report["cpu_ms_per_request"], "CPU ms per request, by process (cache bypassed)")
    lines += [
        "",
        "## Exact cache hit (greedy, response cache on): time to the first token, ms",
        "",
        "| path | TTFT p50 | TTFT p99 | total p50 | total p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in report["cache_hit"].items():
        lines.append(
            f"| {name} | {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} | {r['total_p50_ms']:.2f} | "
            f"{r['total_p99_ms']:.2f} |"
        )
    lines += _cpu_table(report["cache_hit_cpu_ms_per_request"], "CPU ms per cache-hit request, by process")
    return "\n".join(lines) + "\n"


_PATHS = [
    ("direct_worker", "the client calls the worker's internal Generate itself (the baseline)"),
    ("bare_relay_x2 (floor)", "two relays that only copy messages (grpc.aio), in front of the worker"),
    (
        "router",
        "the router process; its worker streams ride one connection per worker to the worker's "
        "stream transport (plain TCP)",
    ),
    (
        "gateway_static_key",
        "gateway process -> router process -> worker (`meshserve up --split-router`; API key from settings)",
    ),
    ("gateway_stored_key", "the same with an API key from the Redis key store"),
    (
        "gateway_embedded_router",
        "the gateway with the router in its process (`meshserve up`'s default layout) -> worker",
    ),
]


def _paired_table(report: dict[str, Any]) -> list[str]:
    """Each path against the direct call alone, alternated request by request (benchmarks/gateway/hops_pairs.py)."""
    pairs = report.get("paired")
    if not pairs:
        return []
    lines = [
        "",
        "## Paired with the direct call (ms): each path alone, alternated request by request with a direct call",
        "",
        "In the round robin above the worker serves every request while a hop's process serves one in eight and",
        "idles in between, so its added time is the hop's cost *cold*. Here the hop's process serves every other",
        "request, as under steady traffic: both sides of the subtraction are equally warm.",
        "",
        "| path | direct TTFT p50 (its pairs) | TTFT p50 | added TTFT p50 | added TTFT p99 | added total p50 "
        "| added total p99 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in pairs.items():
        lines.append(
            f"| {name} | {r['base_ttft_p50_ms']:.2f} | {r['ttft_p50_ms']:.2f} | {r['added_ttft_p50_ms']:+.2f} | "
            f"{r['added_ttft_p99_ms']:+.2f} | {r['added_total_p50_ms']:+.2f} | {r['added_total_p99_ms']:+.2f} |"
        )
    return lines


def _targets(report: dict[str, Any]) -> list[str]:
    """Issue 3's target for each gateway layout (on the paired numbers when the run has them), and what
    the paths are."""
    lines = ["", "Paths: " + "; ".join(f"`{name}`: {what}" for name, what in _PATHS if name in report["latency"]) + "."]
    pairs = report.get("paired") or {}
    lines += [
        "",
        "Target (issue 3): gateway + router add <= 1.5 ms TTFT p50 and <= 5 ms p99 over a direct worker call"
        + (" (paired numbers; the round robin's in brackets)." if pairs else "."),
        "",
    ]
    for name in ("gateway_embedded_router", "gateway_static_key", "gateway_stored_key"):
        rr = report["latency"].get(name)
        r = pairs.get(name, rr)
        if r is None or rr is None:
            continue
        ok = r["added_ttft_p50_ms"] <= 1.5 and r["added_ttft_p99_ms"] <= 5.0
        rr_added = f"{rr['added_ttft_p50_ms']:+.2f} / {rr['added_ttft_p99_ms']:+.2f}"
        cold = f" (round robin {rr_added})" if name in pairs else ""
        lines.append(
            f"- `{name}`: {r['added_ttft_p50_ms']:+.2f} ms p50, {r['added_ttft_p99_ms']:+.2f} ms p99{cold}: "
            f"**{'PASS' if ok else 'FAIL'}**"
        )
    hit = report["cache_hit"]
    best = min((hit[n]["ttft_p50_ms"], n) for n in hit if n.startswith("gateway"))
    lines.append(
        f"- exact-hit TTFT through the gateway (issue 4: p50 <= 3 ms over gRPC): best {best[0]:.2f} ms (`{best[1]}`), "
        + ", ".join(f"`{n}` {hit[n]['ttft_p50_ms']:.2f}" for n in hit if n.startswith("gateway"))
    )
    return lines


def _cpu_table(cpu: dict[str, dict[str, float]], title: str) -> list[str]:
    names = ["client", "gateway", "router", "gateway_embedded"]
    names += ["relay0", "relay1"]
    names += ["relay_sync0", "relay_sync1", "worker", "redis"]
    names = [n for n in names if any(n in row for row in cpu.values())]
    lines = ["", f"## {title}", "", "| path | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for path, row in cpu.items():
        lines.append(f"| {path} | " + " | ".join(f"{row.get(n, 0.0):.2f}" for n in names) + " |")
    return lines


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hops.json").write_text(json.dumps(report, indent=2) + "\n")
    earlier_runs.write(out / "hops.md", markdown(report))
