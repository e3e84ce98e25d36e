"""``meshserve bench [SUBCOMMAND]``: the benchmark suites.

``meshserve bench load|soak|gateways|relay|worker-runtime|tiers-ab|wake|cancel|report|spec|tp-prefix|batch|edge|``
``edge-n|edge-logprobs|edge-structured|edge-prefill|edge-int4-kernel|edge-quality|structured-guarantees``
``...`` run the harness of issue 9, the cloud engine's speculative/TP benchmark and the edge tier's (each has
``-h``); anything else (``meshserve bench``, ``meshserve bench --only cloud``, ...) goes to
:func:`benchmarks.mesh.run.main`, the mesh-overhead benchmark, unchanged.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "load": ("benchmarks.load.bench", "open/closed-loop load with workload mixes and baselines; JSON + PNG"),
    "soak": ("benchmarks.load.soak", "N minutes at 80 % of measured capacity; fails on RSS / fd growth > 5 %"),
    "gateways": ("benchmarks.gateway.vs_litellm", "gateway overhead: meshserve vs LiteLLM in front of a fake backend"),
    "relay": ("benchmarks.gateway.relay", "tokens relayed per second through gateway + router (instant worker)"),
    "worker-runtime": (
        "benchmarks.worker.runtime",
        "the worker runtime alone over a zero-cost engine, this tree vs --ab-tree's (issue 37)",
    ),
    "tiers-ab": (
        "benchmarks.worker.tiers_ab",
        "edge and cloud workers as real processes, this tree vs --ab-tree's, with the issue-27 references (issue 37)",
    ),
    "wake": (
        "benchmarks.mesh.wake",
        "a sleeping or stopped model's first request vs the same model awake; 64 at once; neighbours (issue 39)",
    ),
    "cancel": ("benchmarks.mesh.cancel", "decode steps a worker runs after the client cancels (edge and cloud)"),
    "report": ("benchmarks.report", "write docs/benchmarks/README.md from the benchmarks' JSON files"),
    "spec": ("benchmarks.cloud.spec", "cloud engine: speculative decoding speed-up/acceptance, TP=3 vs TP=1"),
    "tp-prefix": ("benchmarks.cloud.tp_prefix", "TTFT with prefix KV through Redis between a TP=3 worker and TP=1"),
    "batch": ("benchmarks.batch.priority", "interactive TTFT p99 with and without a batch running (issue 28)"),
    "edge": (
        "benchmarks.edge.mesh",
        "edge tier: single-stream roofline share, 16 vs 1 stream scaling, memory per stream",
    ),
    "structured-guarantees": (
        "benchmarks.structured.guarantees",
        "structured output's guarantees on the real model, both tiers and front doors (rates, TARGET lines)",
    ),
    "edge-structured": (
        "benchmarks.edge.structured",
        "edge tier: per-token CPU at 16 streams with a JSON-schema constraint vs without",
    ),
    "edge-prefill": (
        "benchmarks.edge.prefill_groups",
        "edge tier: TTFT of 16 prompts at once, one prefill call per prompt length vs one per prompt",
    ),
    "edge-n": ("benchmarks.edge.n_choices", "edge tier: n=4 choices vs four separate requests, time to the last token"),
    "edge-logprobs": (
        "benchmarks.edge.logprobs",
        "edge tier: per-token CPU at 16 streams with top_logprobs=5 vs without",
    ),
    "edge-int4-kernel": (
        "benchmarks.edge.int4_kernel.bench",
        "edge tier: our row-invariant AVX2 int4 kernel vs onnxruntime's MatMulNBits, one thread (issue 27 lead)",
    ),
    "edge-quality": (
        "benchmarks.edge.quality",
        "edge tier: perplexity / fp32 agreement of the engine's graphs with either int4 kernel (issue 27)",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: meshserve bench [SUBCOMMAND] ...\n\nsubcommands:")
        for name, (_module, text) in SUBCOMMANDS.items():
            print(f"  {name:9} {text}")
        print("\nwithout a subcommand: the mesh-overhead benchmark; its options:\n")
    return int(importlib.import_module("benchmarks.mesh.run").main(argv) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
