"""Markdown of :mod:`benchmarks.cache.bench` reports (docs/benchmarks/cache.md)."""

from __future__ import annotations

BLOCK_SHAPE = (30, 2, 3, 16, 64)  # SmolLM2-135M: 30 layers, K/V, 3 KV heads, 16 tokens, head_dim 64
"""Shape of one KV block in the benchmark (layers, k/v, KV heads, block tokens, head dim)."""


def _load(x: object) -> str:
    return " / ".join(f"{v:.2f}" for v in x) if isinstance(x, list) else "not recorded"


def markdown(report: dict[str, object]) -> str:
    r = report["responses"]
    k = report["kv"]
    assert isinstance(r, dict) and isinstance(k, dict)
    lines = [
        "# Cache benchmark",
        "",
        f"{report['date']} · {report['machine']} · `{report['command']}`",
        "",
        f"Load average (1/5/15 min) at the start {_load(report.get('load_average_start'))}, after the library"
        f" benchmark {_load(report.get('load_average_end'))} (2 CPUs: above 2, other work competed for them).",
        "",
        f"## Response entries ({r['entry_bytes']} B: 128 tokens + text) — ours vs raw redis-py",
        "",
        "| op | ours p50 ms | raw p50 ms | p50 overhead | ours p99 ms | raw p99 ms | ours CPU µs | raw CPU µs "
        "| CPU overhead |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for op in ("get", "get_vs_raw_without_timeout", "get_vs_same_client", "put", "put_with_budget"):
        x = r[op]
        lines.append(
            f"| {op} | {x['ours_p50_ms']:.3f} | {x['raw_p50_ms']:.3f} | {x['p50_overhead_pct']:+.1f} % "
            f"| {x['ours_p99_ms']:.3f} | {x['raw_p99_ms']:.3f} | {x['ours_cpu_us']:.0f} | {x['raw_cpu_us']:.0f} "
            f"| {x['cpu_overhead_pct']:+.1f} % |"
        )
    lines += [
        "",
        "| op, 16 concurrent | ours ops/s | raw ops/s | ours / raw | ours CPU µs/op | raw CPU µs/op | CPU overhead |",
        "|---|---|---|---|---|---|---|",
    ]
    for op in ("get_concurrent", "put_concurrent"):
        x = r[op]
        lines.append(
            f"| {op} | {x['ours_ops_s']:.0f} | {x['raw_ops_s']:.0f} | {x['throughput_ratio']:.3f} "
            f"| {x['ours_cpu_us']:.0f} | {x['raw_cpu_us']:.0f} | {x['cpu_overhead_pct']:+.1f} % |"
        )
    lines += [
        "",
        f"## KV blocks (fp16 {list(BLOCK_SHAPE)} = {k['block_bytes']} B per block, chain of {k['chain_blocks']}"
        f" = {k['chain_mb']:.1f} MB) — ours vs raw redis-py",
        "",
        "| op | ours p50 ms | raw p50 ms | p50 overhead | ours MB/s | raw MB/s | ours CPU ms | raw CPU ms "
        "| CPU overhead |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for op in ("put", "put_with_budget", "load"):
        if op not in k:  # reports written before the row existed
            continue
        x = k[op]
        lines.append(
            f"| {op} | {x['ours_p50_ms']:.2f} | {x['raw_p50_ms']:.2f} | {x['p50_overhead_pct']:+.1f} % "
            f"| {x['ours_mb_s']:.0f} | {x['raw_mb_s']:.0f} | {x['ours_cpu_us'] / 1000:.2f} "
            f"| {x['raw_cpu_us'] / 1000:.2f} | {x['cpu_overhead_pct']:+.1f} % |"
        )
    m = k["match"]
    lines.append(
        f"| match (prefix length, no data) | {m['ours_p50_ms']:.3f} | {m['raw_p50_ms']:.3f} (EXISTS) "
        f"| {m['p50_overhead_pct']:+.1f} % | | | {m['ours_cpu_us'] / 1000:.3f} | {m['raw_cpu_us'] / 1000:.3f} "
        f"| {m['cpu_overhead_pct']:+.1f} % |"
    )
    mesh = report.get("mesh")
    if not isinstance(mesh, dict):
        lines += [
            "",
            "Exact-hit TTFT through the whole mesh: [hops.md](hops.md), section *Exact cache hit* (the real",
            "router, gateway and Redis; a hit never reaches a worker, so the synthetic worker there changes nothing).",
        ]
    if isinstance(mesh, dict):
        lines += ["", "## Exact-hit TTFT through the mesh (gRPC, greedy, 32 tokens)", ""]
        lines += ["| entry point | requests | cache hits | TTFT p50 ms | TTFT p99 ms |", "|---|---|---|---|---|"]
        for name, x in mesh.items():
            lines.append(
                f"| {name} | {x['requests']} | {x['cache_hits']} | {x['ttft_ms_p50']:.2f} | {x['ttft_ms_p99']:.2f} |"
            )
        lines += [
            "",
            "`gateway` and `router`: `meshserve up`'s default layout (the router as its own process);",
            "`gateway_embedded_router`: `meshserve up --embed-router` (the router inside the gateway's process).",
            "Target (issue 4): exact-hit TTFT p50 <= 3 ms over gRPC through the mesh.",
        ]
    lines += [
        "",
        "Raw redis-py does the same transfers without our layer (no header, ledger, breaker, counters). Response",
        "entries: raw has a 1 s socket read timeout (redis-py's way to bound a call; ours: the guard's watchdog);",
        "`get_vs_raw_without_timeout`: a default client with no timeout at all; `get_vs_same_client`: the very",
        "client our cache wraps (no socket timeout, no retries) called bare: the cost of our layer alone (decoding",
        "the header and 128 token ids, guard, counters). `put_with_budget`: both sides send SET + the same",
        "accounting script in one pipeline. KV: raw computes the same chain of SHA-256 block keys with hashlib;",
        "`match` is one round trip on both sides (ours: the prefix-length script; raw: one EXISTS of the 32 keys,",
        "a count rather than a prefix length). Our KV puts always use the ledger (the byte budget): KV `put` is",
        "against bare SETs, KV `put_with_budget` against the same SETs + the same accounting script in one",
        "pipeline (the same transfers: the like-for-like row).",
        "Wall latencies on this shared 2-CPU machine swing with other load; the CPU columns (client process CPU",
        "per op, Redis excluded) are what our layer costs on top of redis-py. Each pair alternates which side",
        "goes first; throughput ratios are medians of per-pair ratios.",
        "",
    ]
    return "\n".join(lines)
