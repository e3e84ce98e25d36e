"""Text of load runs: one line per step, the Markdown report, and two runs side by side."""

from __future__ import annotations

import math
from typing import Any

COLUMNS = (
    ("requests_per_s", "req/s"),
    ("tokens_per_s", "tok/s"),
    ("ttft_ms_p50", "TTFT p50"),
    ("ttft_ms_p95", "TTFT p95"),
    ("ttft_ms_p99", "TTFT p99"),
    ("itl_ms_p50", "ITL p50"),
    ("itl_ms_p99", "ITL p99"),
    ("e2e_ms_p50", "e2e p50"),
    ("e2e_ms_p95", "e2e p95"),
    ("e2e_ms_p99", "e2e p99"),
)


TARGETS = {
    "mesh_grpc": "gRPC `Generate` / one-turn `Chat` through gateway (API key, Redis rate limits) → router → workers",
    "mesh_http": "streaming OpenAI HTTP through Envoy → HTTP adapter → gateway → router → workers",
    "direct_worker": "one edge worker over its internal API, every kind (long prompts too): no gateway, router, cache",
    "naive_transformers": (
        "benchmarks/load/naive_server.py: aiohttp + fp32 transformers `generate` in a thread per request"
    ),
}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def _mapping(d: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in d.items()) or "none"


def step_line(target: str, load: float, s: dict[str, Any]) -> str:
    return (
        f"{target} @ {load:g}: {s['ok']}/{s['requests']} ok, {s['requests_per_s']:.2f} req/s, "
        f"{s['tokens_per_s']:.1f} tok/s, TTFT p50 {_fmt(s['ttft_ms_p50'])} ms, e2e p99 {_fmt(s['e2e_ms_p99'])} ms, "
        f"errors {_mapping(s['errors'])}"
    )


def markdown(report: dict[str, Any]) -> str:
    load_name = "offered req/s" if report["mode"] == "open" else "concurrency"
    w = report["workload"]
    lines = [
        f"# Load run `{report['name']}` ({report['mode']} loop)",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs (shared with other work; 1-min load average "
        f"{report['machine']['load_avg_1m']:.2f} at the start) · `{report['command']}`",
        "",
        f"Workload: short {w['short']:g} / long {w['long']:g} / chat {w['chat']:g}, cache-hit ratio "
        f"{w['cache_hit_ratio']:g}, {w['max_tokens']} tokens per request, at most {report['max_requests']} requests "
        f"and {report['duration_s']:g} s per step. Latencies in ms over successful requests.",
        "",
        *(f"- `{t}`: {TARGETS[t]}" for t in report["targets"] if t in TARGETS),
        "",
        f"![e2e latency]({report['name']}_e2e.png) ![TTFT]({report['name']}_ttft.png) "
        f"![throughput]({report['name']}_throughput.png)",
        "",
        f"| target | {load_name} | ok/sent | " + " | ".join(label for _k, label in COLUMNS) + " | errors | routes |",
        "|---|---:|---:|" + "---:|" * len(COLUMNS) + "---|---|",
    ]
    for target, steps in report["targets"].items():
        for step in steps:
            s = step["summary"]
            cells = " | ".join(_fmt(s[k]) for k, _label in COLUMNS)
            lines.append(
                f"| {target} | {step['load']:g} | {s['ok']}/{s['requests']} | {cells} | {_mapping(s['errors'])} | "
                f"{_mapping(s['routes'])} |"
            )
    return "\n".join(lines) + "\n"


def compare(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> str:
    """Every (target, load) the two runs share: each metric in A, in B, and the change in %."""
    lines = [
        f"A = {name_a} ({a.get('date', '?')}, {a.get('command', '?')})",
        f"B = {name_b} ({b.get('date', '?')}, {b.get('command', '?')})",
        "",
        "| target | load | metric | A | B | change |",
        "|---|---:|---|---:|---:|---:|",
    ]
    shared = 0
    for target, steps in a.get("targets", {}).items():
        other = {s["load"]: s["summary"] for s in b.get("targets", {}).get(target, [])}
        for step in steps:
            if step["load"] not in other:
                continue
            shared += 1
            sa, sb = step["summary"], other[step["load"]]
            for key, label in COLUMNS:
                va, vb = sa.get(key, float("nan")), sb.get(key, float("nan"))
                ok = va and not math.isnan(va) and not math.isnan(vb)
                change = f"{(vb / va - 1) * 100:+.1f} %" if ok else ""
                lines.append(f"| {target} | {step['load']:g} | {label} | {_fmt(va)} | {_fmt(vb)} | {change} |")
    if not shared:
        lines.append("| (no target and load in common) | | | | | |")
    return "\n".join(lines) + "\n"
