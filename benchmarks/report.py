"""``meshserve bench report``: docs/benchmarks/README.md from the JSON files the benchmarks wrote.

One table per performance target of the issues; each row reads one number out of one JSON file
(target, measured, pass/fail, date, the command that reproduces it). A file or key that is not
there shows as "not measured yet" — nothing is estimated or carried over by hand. Then *All reports*:
one line per current report (:data:`REPORTS`: its files, what it measures, the command that writes
it); a file of the directory that no entry names is listed as undescribed, so the index stays whole.
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


def target_line(row: dict[str, Any]) -> str:
    """The line a benchmark prints for one of its TARGET rows (and writes into its report):
    ``TARGET <name>: <value> (target <bound>): PASS|FAIL``, or ``TARGET <name>: SKIPPED (<why>)``.

    A row: ``name``, ``value``, ``unit`` (``"x"`` is written against the number, any other after a
    space, ``""`` none), ``bound`` (the target as printed, e.g. ``"<= 3 s"``), ``pass``; optional
    ``format`` (a format spec for the value, e.g. ``".3f"``). A row with ``skipped`` (why) has no value."""
    if "skipped" in row:
        return f"TARGET {row['name']}: SKIPPED ({row['skipped']})"
    unit = row.get("unit", "")
    value = f"{row['value']:{row.get('format', '')}}{'x' if unit == 'x' else (' ' + unit if unit else '')}"
    return f"TARGET {row['name']}: {value} (target {row['bound']}): {'PASS' if row['pass'] else 'FAIL'}"


_EDGE = "python -m benchmarks.edge.mesh"
_HOPS = "python -m benchmarks.gateway.hops"
_RUNTIME = "meshserve bench worker-runtime --ab-tree TREE --service"
_TIERS = "meshserve bench tiers-ab --ab-tree TREE"
_GUARANTEES = "python -m benchmarks.structured.guarantees"


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


def _target(name: str) -> Callable[[dict[str, Any]], float]:
    """Reads one row of a report's ``targets`` list (the benchmark's own TARGET rows) by name; a
    skipped row has no value (TypeError: shown as not measured)."""
    return lambda d: float(next(row for row in d["targets"] if row["name"] == name)["value"])


def _structured(tier: str, key: str) -> Callable[[dict[str, Any]], float]:
    """One tier's structured-output guarantee measure (benchmarks/structured/guarantees.py's rates):
    ``invalid`` answers of every kind, or the % of JSON and tool answers (``length``) cut at max_tokens."""

    def read(d: dict[str, Any]) -> float:
        rows = [r for r in d["rates"] if r["tier"] == tier]
        if not rows:
            raise KeyError(tier)
        if key == "invalid":
            return float(sum(r["invalid"] for r in rows))
        shaped = [r for r in rows if r["kind"] != "stop"]
        return 100 * sum(r["length"] for r in shaped) / sum(r["answers"] for r in shaped)

    return read


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
    "Structured output: the guarantees on the real model, default sampling, max_tokens 96 (issue 41)": [
        *(
            row
            for tier in ("edge", "cloud")
            for row in (
                Row(f"{tier} tier, invalid answers (JSON object, JSON schema, tools, stop strings; gRPC and HTTP)",
                    "structured_guarantees.json", "0", _structured(tier, "invalid"), "answers",
                    lambda v: v == 0, _GUARANTEES),
                Row(f"{tier} tier, JSON and tool answers finished at max_tokens", "structured_guarantees.json",
                    "≤ 10 %", _structured(tier, "length"), "%", lambda v: v <= 10.0, _GUARANTEES),
            )
        ),
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
    "Worker runtime alone: the engine loop vs the thread per sequence, zero-cost engine (issue 37)": [
        Row("64 streams, tok/s / the old runtime's, in-process", "worker_runtime.json", "≥ 5x",
            _target("worker_runtime_64_streams_vs_old"), "x", lambda v: v >= 5.0, _RUNTIME),
        Row("64 streams, runtime ms per engine step, in-process", "worker_runtime.json", "≤ 0.75 ms",
            _target("worker_runtime_64_streams_ms_per_step"), "ms", lambda v: v <= 0.75, _RUNTIME),
        Row("256 streams, tok/s / the old runtime's, in-process", "worker_runtime.json", "≥ 10x",
            _target("worker_runtime_256_streams_vs_old"), "x", lambda v: v >= 10.0, _RUNTIME),
        Row("256 streams, runtime ms per engine step, in-process", "worker_runtime.json", "≤ 3 ms",
            _target("worker_runtime_256_streams_ms_per_step"), "ms", lambda v: v <= 3.0, _RUNTIME),
        Row("lone stream, runtime overhead per step over 2 ms model steps", "worker_runtime.json", "≤ 0.2 ms",
            _target("worker_runtime_lone_stream_2ms_steps_overhead"), "ms", lambda v: v <= 0.2, _RUNTIME),
        Row("lone stream, runtime overhead per step over 10 ms model steps", "worker_runtime.json", "≤ 0.2 ms",
            _target("worker_runtime_lone_stream_10ms_steps_overhead"), "ms", lambda v: v <= 0.2, _RUNTIME),
        Row("64 streams through a real gateway and worker process, tok/s / the old tree's", "worker_runtime.json",
            "≥ 2x", _target("worker_runtime_service_64_streams_vs_old"), "x", lambda v: v >= 2.0, _RUNTIME),
    ],
    "Both tiers' real workers, this tree vs the tree before the engine loop (issue 37: no regression)": [
        Row("edge, lone stream: the new tree's ratio to onnxruntime-genai / the old tree's", "tiers_ab.json",
            "≥ 1.0x", _target("edge_lone_stream_vs_ortgenai_new_vs_old"), "x", lambda v: v >= 1.0, _TIERS),
        Row("edge, 16 streams: the new tree's ratio to llama.cpp / the old tree's", "tiers_ab.json", "≥ 1.0x",
            _target("edge_16_streams_vs_llamacpp_new_vs_old"), "x", lambda v: v >= 1.0, _TIERS),
        Row("edge, lone stream, the new tree / onnxruntime-genai (issue 27's target, same run)", "tiers_ab.json",
            "≥ 1.0x", _target("edge_single_stream_vs_ortgenai"), "x", lambda v: v >= 1.0, _TIERS),
        Row("edge, 16 streams, the new tree / llama.cpp (issue 27's target, same run)", "tiers_ab.json", "≥ 1.25x",
            _target("edge_16_streams_vs_llamacpp"), "x", lambda v: v >= 1.25, _TIERS),
        Row("cloud worker on CPU, 16 streams, tok/s new / old", "tiers_ab.json", "≥ 1.0x",
            _target("cloud_16_streams_new_vs_old"), "x", lambda v: v >= 1.0, _TIERS),
        Row("cloud worker on CPU, 64 streams, tok/s new / old", "tiers_ab.json", "≥ 1.0x",
            _target("cloud_64_streams_new_vs_old"), "x", lambda v: v >= 1.0, _TIERS),
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


@dataclass(frozen=True)
class Report:
    """One current report: its files, what it measures, the command that writes it."""

    markdown: str | None
    """The Markdown report, relative to the benchmarks directory (None: the benchmark writes none)."""
    data: str | None
    """Its JSON file in the benchmarks directory."""
    measures: str
    command: str
    charts: tuple[str, ...] = ()
    """PNG files the same run wrote beside it."""

    def files(self) -> list[str]:
        return [name for name in (self.markdown, self.data, *self.charts) if name is not None]


def _load_charts(name: str) -> tuple[str, ...]:
    return tuple(f"{name}_{kind}.png" for kind in ("e2e", "ttft", "throughput"))


REPORTS: list[Report] = [
    Report("hops.md", "hops.json", "gateway + router over a direct worker call, model compute removed: added "
           "TTFT/e2e (round robin and paired), CPU per request by process, exact-hit TTFT (issues 3, 4)", _HOPS),
    Report("hops_ab.md", "hops_ab.json", "the hops benchmark with two source trees side by side in one run",
           "python -m benchmarks.gateway.hops --ab-tree TREE"),
    Report("frontdoor.md", "frontdoor.json", "Envoy, HTTP adapter and gateway over the router and over a real edge "
           "worker (max_tokens 1); cache-hit TTFT over SSE vs gRPC (issue 3)",
           "python -m benchmarks.gateway.frontdoor"),
    Report("frontdoor_split.md", "frontdoor_split.json", "the front-door benchmark with the router as its own "
           "process", "python -m benchmarks.gateway.frontdoor --split-router"),
    Report("mesh_overhead.md", "mesh_overhead.json", "gateway + router vs the worker called directly, real model",
           "meshserve bench"),
    Report("relay.md", "relay.json", "tokens relayed per second through gateway + router, paced and instant "
           "synthetic worker (issue 9)", "meshserve bench relay"),
    Report("relay_ab.md", "relay_ab.json", "the relay benchmark with two source trees side by side in one run",
           "meshserve bench relay --ab-tree TREE"),
    Report("gateways.md", "gateways.json", "meshserve's front doors vs the LiteLLM proxy over one fake OpenAI "
           "backend (issue 9)", "meshserve bench gateways"),
    Report("ratelimit.md", "ratelimit.json", "the gateway's Redis rate limiter: admit + settle per request",
           "python -m benchmarks.gateway.ratelimit"),
    Report("tracing.md", "tracing.json", "tracing's cost per request", "python -m benchmarks.gateway.tracing"),
    Report("request_path.md", "request_path.json", "the files and functions one request runs through, gateway "
           "and worker", "python scripts/request_path.py"),
    Report("cache.md", "cache.json", "the cache layer vs raw redis-py; cache-hit TTFT through the mesh (issue 4)",
           "python -m benchmarks.cache.bench"),
    Report("router.md", "router.json", "cache-aware vs round-robin routing, simulated",
           "python -m benchmarks.router.bench"),
    Report("router_prefix.md", "router_prefix.json", "cache-aware vs round-robin routing over real cloud workers "
           "(prefix hit rate, prefill tokens, TTFT)", "python -m benchmarks.router.prefix"),
    Report("edge.md", "edge.json", "the edge tier through the mesh vs onnxruntime-genai and llama.cpp; roofline "
           "share, 1/4/16-stream scaling, memory per stream, the engines in-process (issues 6, 27)",
           "python -m benchmarks.edge"),
    Report("edge_int4_kernel.md", "edge_int4_kernel.json", "our int4 kernel vs onnxruntime's MatMulNBits, one "
           "thread", "meshserve bench edge-int4-kernel"),
    Report("edge_quality.md", "edge_quality.json", "perplexity of the edge graph with our int4 kernel vs MLAS' "
           "(issue 27)", "meshserve bench edge-quality"),
    Report("edge_logprobs.md", "edge_logprobs.json", "edge per-token CPU at 16 streams with top_logprobs=5 vs "
           "without (issue 24)", "meshserve bench edge-logprobs"),
    Report("edge_structured.md", "edge_structured.json", "edge per-token CPU at 16 streams with a JSON-schema "
           "constraint vs without (issue 24)", "meshserve bench edge-structured"),
    Report("edge_n.md", "edge_n.json", "n=4 choices vs four separate requests, time to the last token (issue 24)",
           "meshserve bench edge-n"),
    Report("edge_prefill.md", "edge_prefill.json", "16 new prompts at once: one prefill call per prompt length "
           "vs one per prompt", "meshserve bench edge-prefill"),
    Report("cloud.md", "cloud.json", "the cloud engine on CPU: continuous batching vs transformers, prefix KV "
           "reuse local and through Redis (issues 5, 7)", "meshserve bench --only cloud"),
    Report("cloud_spec.md", "cloud_spec.json", "speculative decoding speed-up and acceptance; tensor parallelism "
           "(issue 7)", "meshserve bench spec"),
    Report("cloud_tp_prefix.md", "cloud_tp_prefix.json", "prefix KV through Redis between a TP=3 worker and TP=1",
           "meshserve bench tp-prefix"),
    Report("cloud_gpu.md", "cloud_gpu.json", "the cloud engine on a GPU: graph-captured decode (issue 22)",
           "python -m benchmarks.cloud.gpu"),
    Report("worker_runtime.md", "worker_runtime.json", "the worker runtime alone over a zero-cost engine, this "
           "tree vs the tree before the engine loop, in-process and through the service (issue 37)", _RUNTIME),
    Report("tiers_ab.md", "tiers_ab.json", "both tiers' real workers, this tree vs the tree before the engine "
           "loop, with the issue-27 references (issue 37)", _TIERS),
    Report("structured_guarantees.md", "structured_guarantees.json", "structured output's guarantees on the real "
           "model, both tiers and front doors: invalid answers, answers at max_tokens (issue 41)", _GUARANTEES),
    Report("wake.md", "wake.json", "a sleeping or stopped model's first token vs the same model awake, resident "
           "memory asleep (also by model size), 64 requests at a sleeping model, neighbours' TTFT during wakes "
           "(issue 39)",
           "meshserve bench wake"),
    Report("cancel.md", "cancel.json", "decode steps a worker runs after the client cancels (issue 7)",
           "meshserve bench cancel"),
    Report("batch.md", "batch.json", "interactive TTFT p99 while a batch runs (issue 28)", "meshserve bench batch"),
    Report("restart.md", "restart.json", "each service of `meshserve up` back after kill -9 under load (issue 26)",
           "python -m benchmarks.mesh.restart"),
    Report("load.md", "load.json", "closed-loop load through the mesh vs baselines, workload mix; charts",
           "meshserve bench load", _load_charts("load")),
    Report("load_open.md", "load_open.json", "open-loop load (offered request rates) through the mesh; charts",
           "meshserve bench load --mode open --name load_open", _load_charts("load_open")),
    Report("../soak.md", "soak.json", "10 minutes at 80 % of measured capacity: RSS and open-fd growth (issue 9)",
           "meshserve bench soak --minutes 10"),
]  # fmt: skip
"""Every current report; tests/unit/benchmarks/test_report.py checks that it names each file of docs/benchmarks."""


def all_reports(bench_dir: Path) -> list[str]:
    """The *All reports* lines: one per entry of :data:`REPORTS` with a file here, then any file of the
    directory no entry names (README.md aside)."""
    lines = []
    named: set[str] = {"README.md"}
    for report in REPORTS:
        named.update(report.files())
        present = [name for name in report.files() if (bench_dir / name).exists()]
        if not present:
            continue
        links = ", ".join(f"[{name.replace('../', 'docs/')}]({name})" for name in present)
        lines.append(f"- {links}: {report.measures}. `{report.command}`")
    strays = sorted(p.name for p in bench_dir.iterdir() if p.is_file() and p.name not in named)
    lines += [f"- [{name}]({name}): not described yet (add it to benchmarks/report.py's REPORTS)" for name in strays]
    return lines


def _fmt(v: float, unit: str) -> str:
    if unit == "answers":  # a count
        return f"{v:,.0f}"
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
        "",
        "The index of docs/benchmarks: every benchmark has one current report here, listed under "
        "[All reports](#all-reports) with what it measures and the command that writes it; the tables below "
        "judge the targets from those reports' JSON. Earlier runs are rows of each report's *Earlier runs* "
        "table, their full text in git.",
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
    lines += [
        "",
        "## All reports",
        "",
        "One current report per benchmark (and per mode that writes its own file: the split layout, the A/B run of "
        "two trees, the open loop). A report may end with *Earlier runs*: one row per run before it, with the commit "
        "that holds that run's full report (benchmarks/earlier_runs.py keeps the section when the benchmark "
        "rewrites the report). Each line: the files, what they measure, the command that writes them.",
        "",
        *(all_reports(bench_dir) or ["none"]),
    ]
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
