"""The edge engine on a chosen CPU set: issue 6's two targets per thread count, and decode-call CPU by rows.

Pin the process with ``taskset`` (the bandwidth probe and the engine then see the same cores)::

  taskset -c 0,1 python -m benchmarks.edge.cores engine --threads 2 --out cores2.json
  taskset -c 2 python -m benchmarks.edge.cores kernel --out kernel.json

``engine``: the read bandwidth (benchmarks.edge.mesh's probe, the better of 1 and ``--threads`` threads) and the
roofline (bandwidth / weight bytes read per decode step), then benchmarks/edge/direct.py's interleaved
in-process rounds at 1 / 4 / 16 streams for each engine kind, each judged against the two targets
(single-stream decode >= 50 % of the roofline, 16 streams >= 4x one stream). No mesh: see benchmarks/edge/mesh.py.

``kernel``: one intra-op thread, so a decode call runs on the engine's batch thread and that thread's CPU
time is the call's. CPU ms per call at M = 1 (``batched-1row``, one stream), 2 (``batched``, one stream and
its dummy row) and 16 (16 streams), from a 100-token prompt (past length 100 .. 100 + ``--tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.edge import direct as edge_direct

KERNEL_CASES = (("batched-1row", 1), ("batched", 1), ("batched", 16))
"""(engine kind, streams) whose decode calls have 1, 2 and 16 rows."""


class DecodeTimer:
    """Wraps ``engine._decode``: while ``on``, records each call of ``rows`` rows as (cpu ms, wall ms, past)."""

    def __init__(self, engine: Any, rows: int) -> None:
        self.rows, self.on = rows, False
        self.calls: list[tuple[float, float, int]] = []
        inner = engine._decode

        def timed(seqs: list[Any]) -> Any:
            rows = max(engine.min_rows, len(seqs))
            past = max(seq.kv_len for seq in seqs)
            cpu, wall = time.thread_time(), time.perf_counter()
            out = inner(seqs)
            if self.on and rows == self.rows:
                self.calls.append((1000 * (time.thread_time() - cpu), 1000 * (time.perf_counter() - wall), past))
            return out

        engine._decode = timed


def summarize_calls(calls: Sequence[tuple[float, float, int]]) -> dict[str, Any]:
    return {
        "calls": len(calls),
        "cpu_ms": statistics.median(c for c, _, _ in calls),
        "wall_ms": statistics.median(w for _, w, _ in calls),
        "past_min": min(p for _, _, p in calls),
        "past_max": max(p for _, _, p in calls),
    }


def kernel_table(
    model_dir: Path, prompt: list[int], *, cases: Sequence[tuple[str, int]], tokens: int, repeats: int
) -> dict[int, dict[str, Any]]:
    """``{rows: summary}`` of one-thread decode calls, one engine per (kind, streams) case."""
    long_prompt = (prompt * (100 // max(1, len(prompt)) + 1))[:100]
    table: dict[int, dict[str, Any]] = {}
    for kind, streams in cases:
        engine: Any = edge_direct.load_engine(kind, model_dir, 1, max(2, streams))  # a OrtEngine
        try:
            timer = DecodeTimer(engine, max(engine.min_rows, streams))
            edge_direct._round(engine, long_prompt, streams, 4)  # warm-up
            timer.on = True
            for _ in range(repeats):
                edge_direct._round(engine, long_prompt, streams, tokens)
        finally:
            engine.close()
        if timer.calls:
            table[timer.rows] = summarize_calls(timer.calls)
    return table


def judge(direct: dict[str, list[dict[str, Any]]], roofline: float) -> dict[str, dict[str, Any]]:
    """Per engine kind: single-stream share of the roofline, top-vs-1 wall and CPU ratios, targets met."""
    out = {}
    for kind, rows in direct.items():
        one, top = rows[0], rows[-1]
        share = one["decode_tokens_per_s_per_stream"] / roofline
        ratio = top["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"]
        out[kind] = {
            "roofline_share": share,
            "ratio_top_vs_1": ratio,
            "cpu_ratio_top_vs_1": one["cpu_ms_per_token"] / top["cpu_ms_per_token"],
            "roofline_target_met": share >= 0.5,
            "scaling_target_met": ratio >= 4.0,
        }
    return out


def engine_report(
    model_dir: Path, prompt: list[int], *, threads: int, kinds: Sequence[str], tokens: int, repeats: int
) -> dict[str, Any]:
    from benchmarks.edge.mesh import read_bandwidth_gbs, weight_bytes_per_token

    per_token, total = weight_bytes_per_token(model_dir)
    bandwidth = max(read_bandwidth_gbs(1), read_bandwidth_gbs(threads))
    roofline = bandwidth * 1e9 / per_token
    direct = edge_direct.measure(
        kinds, model_dir, prompt, threads=threads, counts=(1, 4, 16), max_tokens=tokens, repeats=repeats
    )
    return {
        "threads": threads,
        "cpus": sorted(os.sched_getaffinity(0)),
        "weight_bytes_per_token": per_token,
        "weight_bytes_total": total,
        "read_bandwidth_gbs": bandwidth,
        "roofline_tokens_per_s": roofline,
        "direct": direct,
        "judged": judge(direct, roofline),
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        f"cpus {report['cpus']}, {report['threads']} threads: bandwidth {report['read_bandwidth_gbs']:.1f} GB/s, "
        f"roofline {report['roofline_tokens_per_s']:.0f} tok/s"
    ]
    for kind, rows in report["direct"].items():
        j = report["judged"][kind]
        agg = " / ".join(f"{r['aggregate_tokens_per_s']:.1f}" for r in rows)
        cpu = " / ".join(f"{r['cpu_ms_per_token']:.2f}" for r in rows)
        lines.append(
            f"  {kind}: aggregate tok/s {agg} ({j['ratio_top_vs_1']:.2f}x; CPU ms/token {cpu}, "
            f"{j['cpu_ratio_top_vs_1']:.2f}x); single stream {rows[0]['decode_tokens_per_s_per_stream']:.1f} tok/s "
            f"= {100 * j['roofline_share']:.0f} % of the roofline; targets: roofline "
            f"{'PASS' if j['roofline_target_met'] else 'FAIL'}, scaling {'PASS' if j['scaling_target_met'] else 'FAIL'}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.edge.cores", description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("engine", "kernel"))
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (engine mode; kernel uses 1)")
    parser.add_argument("--kinds", default="batched,batched-1row", help="engine kinds (benchmarks/edge/direct.py)")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per stream (default 48)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median; default 3)")
    parser.add_argument("--out", type=Path, required=True, help="JSON report")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    from benchmarks.edge.mesh import PROMPT
    from services.common.model_paths import model_paths

    model_dir = model_paths().edge_dir
    prompt = list(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT).ids)
    if args.mode == "engine":
        report = engine_report(
            model_dir, prompt, threads=args.threads, kinds=args.kinds.split(","), tokens=args.tokens,
            repeats=args.repeats,
        )  # fmt: skip
        lines = summary_lines(report)
    else:
        table = kernel_table(model_dir, prompt, cases=KERNEL_CASES, tokens=args.tokens, repeats=args.repeats)
        report = {"cpus": sorted(os.sched_getaffinity(0)), "threads": 1, "by_rows": table}
        lines = [
            f"M={rows}: {r['cpu_ms']:.2f} CPU ms per call ({r['cpu_ms'] / rows:.2f} per row), {r['calls']} calls, "
            f"past {r['past_min']}-{r['past_max']}"
            for rows, r in table.items()
        ]
    report["load_avg_1m_end"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
