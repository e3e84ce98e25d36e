"""Markdown of a soak run (docs/soak.md)."""

from __future__ import annotations

from typing import Any


def markdown(report: dict[str, Any]) -> str:
    v, s, cap = report["verdict"], report["summary"], report["capacity"]
    status = "**PASS**" if v["pass"] else f"**FAIL** (grew: {', '.join(v['grew'])})"
    w = report["workload"]
    lines = [
        "# Soak test",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs, shared with other work (1-min load average "
        f"{report['machine']['load_avg_1m']:.2f} at the end) · `{report['command']}`",
        "",
        f"Result: {status} — no RSS or open-fd series may grow more than {v['max_growth_pct']:g} % between the "
        f"baseline window (from {report['warmup_s'] / 60:g} min, after the warm-up) and the final window "
        f"(last {report['window_s'] / 60:g} min); medians of samples every {report['interval_s']:g} s.",
        "",
        "## Load",
        "",
        f"Workload: short {w['short']:g} / long {w['long']:g} / chat {w['chat']:g}, cache-hit ratio "
        f"{w['cache_hit_ratio']:g}, {w['max_tokens']} tokens per request, gRPC through the gateway.",
        "",
        "| ramp concurrency | req/s | tok/s | e2e p99 ms | errors |",
        "|---:|---:|---:|---:|---|",
    ]
    for step in cap["steps"]:
        x = step["summary"]
        lines.append(
            f"| {step['concurrency']} | {x['requests_per_s']:.2f} | {x['tokens_per_s']:.1f} | {x['e2e_ms_p99']:.1f} "
            f"| {x['errors'] or 'none'} |"
        )
    lines += [
        "",
        f"Capacity {cap['requests_per_s']:.2f} req/s → soak at {report['load_fraction']:g} x = "
        f"{report['rate_requests_per_s']:.2f} req/s (Poisson) for {report['minutes']:g} min: "
        f"{s['requests']} requests, {s['ok']} ok, errors {s['errors'] or 'none'}, routes {s['routes']}; "
        f"TTFT p50/p99 {s['ttft_ms_p50']:.1f}/{s['ttft_ms_p99']:.1f} ms, e2e p50/p99 "
        f"{s['e2e_ms_p50']:.1f}/{s['e2e_ms_p99']:.1f} ms.",
        "",
        "## Resources per service process",
        "",
        "| process / measure | baseline | final | growth % | second-half growth % | |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for key, row in v["series"].items():
        mark = "grew" if key in v["grew"] else "ok"
        late = row.get("second_half_growth_pct")
        late_text = "" if late is None else f"{late:+.2f}"
        lines.append(
            f"| {key} | {row['baseline']:.1f} | {row['final']:.1f} | {row['growth_pct']:+.2f} | {late_text} | {mark} |"
        )
    lines += redis_lines(report) + fd_lines(report)
    raw = report.get("json_path", "docs/benchmarks/soak.json")
    lines += ["", f"Raw samples: `{raw}`. Reproduce: `{report['command']}` (or `make soak`)."]
    return "\n".join(lines) + "\n"


def _mb(value: float) -> str:
    return f"{value / 2**20:.1f}"


def redis_lines(report: dict[str, Any]) -> list[str]:
    """Redis's own counters: is its memory that of a full cache (at maxmemory, evicting)?"""
    r = report.get("redis")
    if not r:
        return []
    rows = []
    for label, x in (("baseline", r["baseline"]), ("final", r["final"])):
        rows.append(
            f"| {label} | {_mb(x['used_memory'])} | {_mb(x['maxmemory'])} | {_mb(x['used_memory_rss'])} "
            f"| {x['evicted_keys']:.0f} | {x['keys']:.0f} | {x['connected_clients']:.0f} |"
        )
    if r["full_before_baseline"]:
        full = f"reached 95 % of maxmemory at {r['full_at_s']:g} s, before the baseline window"
    elif r["full_at_s"] is not None:
        full = f"reached 95 % of maxmemory only at {r['full_at_s']:g} s, after the baseline (growth partly filling)"
    else:
        full = "never reached 95 % of maxmemory: its growth is (partly) the cache filling"
    fill = report.get("fill") or {}
    fill_text = (
        f"Before the soak, {fill['requests'] - fill.get('chat', 0)} distinct one-token prompts and "
        f"{fill.get('chat', 0)} chat turns at concurrency {fill['concurrency']} ({fill['wall_s']:g} s, errors "
        f"{fill['errors'] or 'none'}) filled the prompt-keyed caches and peaked the connection pools"
        + (
            f" (the cloud workers' KV cache is {report['cloud_kv_budget_bytes'] >> 20} MiB, so that its prefixes "
            "fill it before the baseline too)"
            if report.get("cloud_kv_budget_bytes")
            else ""
        )
        + ". "
        if fill.get("requests")
        else ""
    )
    return [
        "",
        "## Redis (maxmemory " + str(report.get("redis_maxmemory", "?")) + ", allkeys-lru)",
        "",
        f"{fill_text}Redis {full}; {r['evicted_during_soak']:.0f} keys evicted between the baseline and the end.",
        "",
        "| sample | used_memory MB | maxmemory MB | RSS MB | evicted_keys | keys | clients |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


def _kinds(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "-"


def fd_lines(report: dict[str, Any]) -> list[str]:
    """Open fds by kind where a process's kinds changed; Redis connections by owning process."""
    kinds = report.get("fd_kinds") or {}
    rows = []
    for name, k in sorted(kinds.items()):
        keys = sorted(set(k["baseline"]) | set(k["final"]))
        changed = [x for x in keys if k["baseline"].get(x, 0) != k["final"].get(x, 0)]
        if changed:
            delta = ", ".join(f"{x} {k['baseline'].get(x, 0)} → {k['final'].get(x, 0)}" for x in changed)
        else:
            delta = "no change"
        th = (report.get("threads") or {}).get(name)
        th_text = "" if th is None else f"{th['baseline']:g} → {th['final']:g}"
        rows.append(f"| {name} | {_kinds(k['final'])} | {delta} | {th_text} |")
    out = []
    if rows:
        out += [
            "",
            "## Open fds by kind (baseline sample → last sample)",
            "",
            "| process | fds at the end | changed since the baseline | threads (baseline → final window) |",
            "|---|---|---|---|",
            *rows,
        ]
    events = [e for e in report.get("log_events") or [] if e["phase"] != "stop"]
    if "log_events" in report and not events:
        out += ["", "The services logged no warning or error during the ramp, the fill and the soak."]
    if events:
        out += [
            "",
            "## Warnings and errors the services logged",
            "",
            "| phase | service | level | event | count |",
            "|---|---|---|---|---:|",
            *(f"| {e['phase']} | {e['service']} | {e['level']} | {e['event']} | {e['count']} |" for e in events[:20]),
        ]
    owners = report.get("redis_clients") or []
    if owners:
        out += [
            "",
            "Redis `CLIENT LIST` by owning process: " + "; ".join(f"{t:g} s: {_kinds(o)}" for t, o in owners) + ".",
        ]
    return out
