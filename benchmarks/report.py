"""``meshserve bench report``: docs/benchmarks/README.md from the JSON files the benchmarks wrote.

One table per performance target of the issues; each row reads one number out of one JSON file
(target, measured, pass/fail, date, the command that reproduces it). A file or key that is not
there shows as "not measured yet" — nothing is estimated or carried over by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOT_MEASURED = "not measured yet"

_EDGE = "python -m benchmarks.edge.mesh"
_HOPS = "python -m benchmarks.gateway.hops"


@dataclass(frozen=True)
class Row:
    """One target checked against one number of one benchmark file."""

    label: str
    source: str
    """JSON file name under the benchmarks directory."""
    target: str
    measure: Callable[[dict[str, Any]], float]
    """Reads the number (raises KeyError/IndexError/TypeError when the file lacks it)."""
    unit: str
    passes: Callable[[float], bool] | None
    """None: a reference number with no pass/fail target."""
    command: str
    """Reproduces it when the file does not name its own command."""


def _dig(d: Any, *keys: Any) -> Any:
    for k in keys:
        d = d[k]
    return d


def _restart_median(service: str) -> Callable[[dict[str, Any]], float]:
    """Reads one service's median time back after kill -9 (benchmarks/mesh/restart.py)."""
    return lambda d: float(_dig(d, "restarts", "services", service, "back_s_median"))


def _edge_round(d: dict[str, Any], streams: int) -> float:
    return float(next(r for r in d["rounds"] if r["streams"] == streams)["aggregate_tokens_per_s"])


def _paired(d: dict[str, Any], path: str, key: str) -> float:
    """A number of hops' paired phase (each path alone against the direct call: benchmarks/gateway/hops_pairs.py)."""
    return float(_dig(d, "paired", path, key))


def _prefix_rounds(d: dict[str, Any]) -> float:
    changes = [100 * (r["cache_aware"]["ttft_ms_p50"] / r["round_robin"]["ttft_ms_p50"] - 1) for r in d["rounds"]]
    return float(statistics.median(changes))


TABLES: dict[str, list[Row]] = {
    "Mesh overhead: gateway + router over a direct worker call (issue 3)": [
        Row("added TTFT p50, synthetic worker (default layout: router in the gateway), paired with direct calls",
            "hops.json", "≤ 1.5 ms", lambda d: _paired(d, "gateway_embedded_router", "added_ttft_p50_ms"), "ms",
            lambda v: v <= 1.5, _HOPS),
        Row("added TTFT p99, synthetic worker (default layout), paired", "hops.json", "≤ 5 ms",
            lambda d: _paired(d, "gateway_embedded_router", "added_ttft_p99_ms"), "ms",
            lambda v: v <= 5.0, _HOPS),
        Row("added e2e p50, synthetic worker (default layout), paired", "hops.json", "≤ 1.5 ms",
            lambda d: _paired(d, "gateway_embedded_router", "added_total_p50_ms"), "ms",
            lambda v: v <= 1.5, _HOPS),
        Row("added TTFT p50, synthetic worker (default layout), round robin of 8 paths (the gateway idle 7 "
            "requests in 8: cold)", "hops.json", "(reference)",
            lambda d: _dig(d, "latency", "gateway_embedded_router", "added_ttft_p50_ms"), "ms", None,
            _HOPS),
        Row("direct worker call, TTFT p50 (how fast the machine ran: 1.62 ms on 2026-11-22 22:37)", "hops.json",
            "(reference)", lambda d: _dig(d, "latency", "direct_worker", "ttft_p50_ms"), "ms", None,
            _HOPS),
        Row("two bare gRPC relays, added TTFT p50, paired (the floor of two Python hops, same run)", "hops.json",
            "(reference)", lambda d: _paired(d, "bare_relay_x2 (floor)", "added_ttft_p50_ms"), "ms", None,
            _HOPS),
        Row("added TTFT p50, real edge worker, max_tokens 1 (default layout)", "frontdoor.json", "≤ 1.5 ms",
            lambda d: _dig(d, "gateway_router_over_worker_max_tokens_1", "gateway -> router -> worker", "added_p50_ms"),
            "ms", lambda v: v <= 1.5, "python -m benchmarks.gateway.frontdoor"),
        Row("added TTFT p99, real edge worker, max_tokens 1 (default layout)", "frontdoor.json", "≤ 5 ms",
            lambda d: _dig(d, "gateway_router_over_worker_max_tokens_1", "gateway -> router -> worker", "added_p99_ms"),
            "ms", lambda v: v <= 5.0, "python -m benchmarks.gateway.frontdoor"),
        # The split layout (a router process of its own) is no deployment's default since 2026-11-26
        # (meshserve up, compose and Kubernetes embed the router): its rows are references.
        Row("split layout (--split-router: the router's own process, one gRPC hop more), synthetic worker, "
            "added TTFT p50, paired", "hops.json", "(reference)",
            lambda d: _paired(d, "gateway_static_key", "added_ttft_p50_ms"), "ms", None, _HOPS),
        Row("split layout, synthetic worker, added e2e p50, paired", "hops.json", "(reference)",
            lambda d: _paired(d, "gateway_static_key", "added_total_p50_ms"), "ms", None, _HOPS),
        Row("split layout, synthetic worker, added e2e p99, paired", "hops.json", "(reference)",
            lambda d: _paired(d, "gateway_static_key", "added_total_p99_ms"), "ms", None, _HOPS),
        Row("split layout, real edge worker, max_tokens 1, added TTFT p50", "frontdoor_split.json", "(reference)",
            lambda d: _dig(d, "gateway_router_over_worker_max_tokens_1", "gateway -> router -> worker", "added_p50_ms"),
            "ms", None, "python -m benchmarks.gateway.frontdoor --split-router"),
    ],
    "Cache-hit TTFT over gRPC through the mesh (issue 4)": [
        Row("exact hit, gateway Generate, p50, split layout", "cache.json", "≤ 3 ms",
            lambda d: _dig(d, "mesh", "gateway", "ttft_ms_p50"), "ms", lambda v: v <= 3.0,
            "python -m benchmarks.cache.bench"),
        Row("exact hit, gateway Generate, p50 (hops run, split layout)", "hops.json", "≤ 3 ms",
            lambda d: _dig(d, "cache_hit", "gateway_static_key", "ttft_p50_ms"), "ms", lambda v: v <= 3.0,
            _HOPS),
        Row("exact hit, gateway Generate, p50, router embedded (default layout)", "cache.json", "≤ 3 ms",
            lambda d: _dig(d, "mesh", "gateway_embedded_router", "ttft_ms_p50"), "ms", lambda v: v <= 3.0,
            "python -m benchmarks.cache.bench"),
        Row("exact hit, gateway Generate, p50 (front-door run, default layout)", "frontdoor.json", "≤ 3 ms",
            lambda d: _dig(d, "cache_hit_ttft", "gateway_grpc Generate (baseline)", "p50_ms"), "ms",
            lambda v: v <= 3.0, "python -m benchmarks.gateway.frontdoor"),
    ],
    "Cache layer vs raw redis-py (issue 4)": [
        Row("response GET p50 overhead", "cache.json", "≤ 10 %",
            lambda d: _dig(d, "responses", "get", "p50_overhead_pct"), "%", lambda v: v <= 10.0,
            "python -m benchmarks.cache.bench"),
        Row("KV block load p50 overhead", "cache.json", "≤ 10 %", lambda d: _dig(d, "kv", "load", "p50_overhead_pct"),
            "%", lambda v: v <= 10.0, "python -m benchmarks.cache.bench"),
    ],
    "Edge tier vs onnxruntime-genai and llama.cpp (issue 27)": [
        Row("single stream through the mesh / onnxruntime-genai's single stream in-process, same run", "edge.json",
            "≥ 1.0x", lambda d: d["targets"]["edge_single_stream_vs_ortgenai"]["ratio"], "x", lambda v: v >= 1.0,
            _EDGE),
        Row("16 streams through the mesh / llama.cpp (Q4_0 of the same GGUF) at 16 streams, same run", "edge.json",
            "≥ 1.25x", lambda d: d["targets"]["edge_16_streams_vs_llamacpp"]["ratio"], "x", lambda v: v >= 1.25,
            _EDGE),
        Row("perplexity on held-out text, the engine's graph with our int4 kernel / with MLAS', same run",
            "edge_quality.json", "≤ 1.005x", lambda d: float(d["target"]["ratio"]), "x", lambda v: v <= 1.005,
            "meshserve bench edge-quality"),
    ],
    "Edge tier: roofline and scaling (issue 6; superseded by issue 27's targets above)": [
        Row("single stream, share of memory-bandwidth roofline", "edge.json", "≥ 50 %",
            lambda d: 100 * d["single_stream_roofline_share"], "%", lambda v: v >= 50.0, _EDGE),
        Row("aggregate tok/s at 16 streams / at 1 stream", "edge.json", "≥ 4x",
            lambda d: _edge_round(d, 16) / _edge_round(d, 1), "x", lambda v: v >= 4.0, _EDGE),
    ],
    "Edge tier: logprobs, structured output, n (issue 24)": [
        Row("per-token CPU at 16 streams, top_logprobs=5 vs without", "edge_logprobs.json", "≤ +5 %",
            lambda d: float(d["cpu_overhead_pct"]), "%", lambda v: v <= 5.0, "meshserve bench edge-logprobs"),
        Row("per-token CPU at 16 streams, JSON-schema constraint vs without", "edge_structured.json", "≤ +15 %",
            lambda d: 100 * float(d["overhead"]), "%", lambda v: v <= 15.0, "meshserve bench edge-structured"),
        Row("n=4 vs 4 separate requests, time to the last token (256-token prompt)", "edge_n.json", "≥ 1.5x",
            lambda d: float(d["rows"][-1]["speedup"]), "x", lambda v: v >= 1.5, "meshserve bench edge-n"),
    ],
    "Batch inference (issue 28)": [
        Row("interactive TTFT p99 rise while a batch runs", "batch.json", "≤ 10 %",
            lambda d: 100 * float(d["rise"]), "%", lambda v: v <= 10.0, "meshserve bench batch"),
    ],
    "Cloud tier vs transformers (issue 7)": [
        Row("tok/s at 16 streams / transformers generate_batch", "cloud.json", "≥ 2.5x",
            lambda d: _dig(d, "throughput", "16", "ours", "tokens_per_s")
            / _dig(d, "throughput", "16", "hf_generate_batch", "tokens_per_s"),
            "x", lambda v: v >= 2.5, "meshserve bench --only cloud"),
        Row("tok/s at 16 streams / transformers sequential generate", "cloud.json", "(reference)",
            lambda d: _dig(d, "throughput", "16", "ours", "tokens_per_s")
            / _dig(d, "throughput", "16", "hf_generate", "tokens_per_s"),
            "x", None, "meshserve bench --only cloud"),
    ],
    "Prefix reuse (issues 5 and 7)": [
        Row("~1k-token prompt TTFT, cold / local prefix", "cloud.json", "≥ 5x",
            lambda d: _dig(d, "prefix_ttft", "local_prefix", "speedup_vs_cold"), "x", lambda v: v >= 5.0,
            "meshserve bench --only cloud"),
        Row("~1k-token prompt TTFT, cold / Redis prefix from another replica", "cloud.json", "≥ 5x",
            lambda d: _dig(d, "prefix_ttft", "redis_prefix_other_replica", "speedup_vs_cold"), "x", lambda v: v >= 5.0,
            "meshserve bench --only cloud"),
        Row("cache-aware vs round-robin routing, TTFT p50 change (simulated)", "router.json",
            "(reference: Ray Serve -60 %)",
            lambda d: _dig(d, "workload", "generous_cache", "ttft_p50_change_pct"), "%", None,
            "python -m benchmarks.router.bench"),
        Row("cache-aware vs round-robin routing, TTFT p50 change (real cloud workers, median of rounds)",
            "router_prefix.json", "(reference: Ray Serve -60 %)", _prefix_rounds, "%", None,
            "python -m benchmarks.router.prefix"),
    ],
    "Speculative decoding (issue 7)": [
        Row("speed-up (CPU per token)", "cloud_spec.json", "≥ 1.5x",
            lambda d: _dig(d, "speculative", "speedup_cpu"), "x", lambda v: v >= 1.5,
            "meshserve bench spec"),
        Row("acceptance rate", "cloud_spec.json", "(reported)",
            lambda d: 100 * _dig(d, "speculative", "acceptance"), "%", None, "meshserve bench spec"),
    ],
    "Cancel latency (issue 7: within one decode step)": [
        Row("decode steps after cancel, p99", "cancel.json", "≤ 1 step", lambda d: d["steps_after_cancel_p99"],
            "steps", lambda v: v <= 1.0, "meshserve bench cancel"),
    ],
    "Tokens relayed per second through gateway + router (issue 9)": [
        Row("tok/s, 32 streams paced one token per 5 ms (synthetic worker)", "relay.json", "≥ 5,000 tok/s",
            lambda d: d["gateway_router_tokens_per_s"], "tok/s", lambda v: v >= 5000.0, "meshserve bench relay"),
    ],
    "Gateway overhead vs LiteLLM, same fake OpenAI backend (issue 9)": [
        Row("meshserve gRPC front door (default layout), added e2e p50 / LiteLLM's, same run", "gateways.json",
            "≤ 0.1x", lambda d: d["targets"]["gateways_grpc_vs_litellm"]["ratio"], "x", lambda v: v <= 0.1,
            "meshserve bench gateways"),
        Row("meshserve HTTP front door (default layout), added e2e p50 / LiteLLM's, same run", "gateways.json",
            "≤ 0.2x", lambda d: d["targets"]["gateways_http_vs_litellm"]["ratio"], "x", lambda v: v <= 0.2,
            "meshserve bench gateways"),
        Row("meshserve HTTP front door, added p50", "gateways.json", "(LiteLLM publishes p50 2 ms)",
            lambda d: _dig(d, "added_ms", "meshserve_http", "p50"), "ms", None, "meshserve bench gateways"),
        Row("LiteLLM proxy, added p50", "gateways.json", "(LiteLLM publishes p50 2 ms)",
            lambda d: _dig(d, "added_ms", "litellm", "p50"), "ms", None, "meshserve bench gateways"),
        Row("meshserve HTTP front door, added p99", "gateways.json", "(LiteLLM publishes p99 13 ms)",
            lambda d: _dig(d, "added_ms", "meshserve_http", "p99"), "ms", None, "meshserve bench gateways"),
        Row("LiteLLM proxy, added p99", "gateways.json", "(LiteLLM publishes p99 13 ms)",
            lambda d: _dig(d, "added_ms", "litellm", "p99"), "ms", None, "meshserve bench gateways"),
    ],
    "Self-healing local mesh: back after kill -9 under load, median of rounds (issue 26)": [
        *(
            Row(f"{label} back serving", "restart.json", "≤ 10 s",
                _restart_median(key), "s",
                lambda v: v <= 10.0, "python -m benchmarks.mesh.restart --rounds 2")
            for key, label in (("edge", "edge worker"), ("cloud-0", "cloud worker"), ("cache", "cache service"),
                               ("redis", "Redis"), ("gateway", "gateway (router inside)"))
        ),
    ],
    "Soak (issue 9)": [
        Row("largest RSS / open-fd growth, baseline window → final window", "soak.json", "≤ 5 %",
            lambda d: max(r["growth_pct"] for r in d["verdict"]["series"].values()), "%", lambda v: v <= 5.0,
            "meshserve bench soak --minutes 10"),
    ],
}  # fmt: skip


def _fmt(v: float, unit: str) -> str:
    if unit == "tok/s":
        return f"{v:,.0f} tok/s"
    if unit == "x":
        return f"{v:.2f}x"
    return f"{v:.2f} {unit}"


def render_row(row: Row, data: dict[str, Any] | None) -> str:
    if data is None:
        return f"| {row.label} | {row.target} | {NOT_MEASURED} | — | — | `{row.command}` |"
    try:
        value = float(row.measure(data))
    except (KeyError, IndexError, TypeError, StopIteration, ZeroDivisionError, ValueError):
        return f"| {row.label} | {row.target} | {NOT_MEASURED} (no such number in {row.source}) | — | — | " + (
            f"`{row.command}` |"
        )
    verdict = "—" if row.passes is None else ("pass" if row.passes(value) else "**fail**")
    date = str(data.get("date", "?"))[:16].replace("T", " ")
    command = data.get("command") or row.command
    return f"| {row.label} | {row.target} | {_fmt(value, row.unit)} | {verdict} | {date} | `{command}` |"


def generate(bench_dir: Path) -> str:
    cache: dict[str, dict[str, Any] | None] = {}

    def load(name: str) -> dict[str, Any] | None:
        if name not in cache:
            path = bench_dir / name
            cache[name] = json.loads(path.read_text()) if path.exists() else None
        return cache[name]

    lines = [
        "# Benchmarks: targets and measurements",
        "",
        "Generated by `meshserve bench report` from the JSON files in this directory; do not edit by hand.",
        "Every number was measured on the 2-core build machine, usually while other work ran on it, so wall",
        "times are noisy (see each benchmark's own .md for its conditions and for CPU-time measures).",
        '"not measured yet" means the benchmark has not written that number here.',
    ]
    for title, rows in TABLES.items():
        lines += [
            "",
            f"## {title}",
            "",
            "| measure | target | measured | pass/fail | date | reproduce |",
            "|---|---|---:|---|---|---|",
        ]
        lines += [render_row(row, load(row.source)) for row in rows]
    runs = sorted(p.name for p in bench_dir.glob("*.json"))
    lines += ["", "## All result files", "", ", ".join(f"[{n}]({n})" for n in runs) or "none"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench report", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("docs/benchmarks"), help="where the JSON files are")
    parser.add_argument("--out", type=Path, default=None, help="README path (default DIR/README.md)")
    args = parser.parse_args(argv)
    text = generate(args.dir)
    out = args.out or args.dir / "README.md"
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
