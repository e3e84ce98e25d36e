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
    lines += ["", f"Raw samples: `docs/benchmarks/soak.json`. Reproduce: `{report['command']}` (or `make soak`)."]
    return "\n".join(lines) + "\n"
