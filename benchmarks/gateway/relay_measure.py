"""One closed-loop relay measure, shared by :mod:`benchmarks.gateway.relay` (this tree's stack),
:mod:`benchmarks.gateway.relay_ab` (two trees' meshes) and the worker runtime's service run
(:mod:`benchmarks.worker.runtime`): ``streams`` concurrent greedy streams of ``max_tokens`` for
``duration`` seconds through one sender, with tokens/s, frames per token and every process's CPU per
1,000 tokens (/proc schedstat). Also the relay's target (issue 9).
"""

from __future__ import annotations

import random
import time
from typing import Any

from benchmarks.gateway.hop_timing import cpu_ns
from benchmarks.load.generator import Result, Sender, Workload, closed_loop, make_items, summarize

TARGET_TOKENS_PER_S = 5000.0
"""Issue 9: tokens relayed per second through gateway + router on 2 cores."""


async def measure(send: Sender, streams: int, max_tokens: int, duration: float, pids: dict[str, int]) -> dict[str, Any]:
    """One round: the load generator's summary plus ``frames_per_token`` and ``cpu_ms_per_1k_tokens``
    (per name of ``pids``)."""
    items = make_items(
        Workload(max_tokens=max_tokens, tier="edge"), 100_000, random.Random(1), tag=f"{time.time_ns()}-"
    )
    before = {n: cpu_ns(pid) for n, pid in pids.items()}
    results: list[Result]
    results, wall = await closed_loop(send, items, streams, duration)
    cpu = {n: cpu_ns(pid) - before[n] for n, pid in pids.items()}
    summary = summarize(results, wall)
    frames = sum(len(r.token_times) for r in results if r.status == "OK")
    tokens = max(1, summary["tokens"])
    summary["frames_per_token"] = round(frames / tokens, 3)
    summary["cpu_ms_per_1k_tokens"] = {n: round(ns / 1e6 / tokens * 1000, 2) for n, ns in cpu.items()}
    return summary
