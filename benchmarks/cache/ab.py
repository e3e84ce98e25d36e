"""Interleaved A/B measurements of two async operations (ours vs raw), robust to a shared machine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np

from benchmarks.stats import percentile

Op = Callable[[], Awaitable[object]]


async def ab_latency(ours: Op, raw: Op, n: int) -> dict[str, float]:
    """Alternate the two ops ``n`` times each; p50/p99 in ms, and this process's CPU per op in µs.

    CPU time (``time.process_time``: every thread of the client, none of Redis) is what a layer over
    redis-py can add; unlike wall time it is not inflated by other load on a shared machine.
    """
    a: list[float] = []
    b: list[float] = []
    cpu = {"ours": 0.0, "raw": 0.0}
    for i in range(n):
        pair = ((ours, a, "ours"), (raw, b, "raw"))
        for op, out, name in pair if i % 2 == 0 else pair[::-1]:
            c0 = time.process_time()
            t0 = time.perf_counter()
            await op()
            out.append((time.perf_counter() - t0) * 1000)
            cpu[name] += time.process_time() - c0
    return {
        "ours_p50_ms": percentile(a, 50),
        "ours_p99_ms": percentile(a, 99),
        "raw_p50_ms": percentile(b, 50),
        "raw_p99_ms": percentile(b, 99),
        "p50_overhead_pct": (percentile(a, 50) / percentile(b, 50) - 1) * 100,
        "ours_cpu_us": cpu["ours"] / n * 1e6,
        "raw_cpu_us": cpu["raw"] / n * 1e6,
        "cpu_overhead_pct": (cpu["ours"] / cpu["raw"] - 1) * 100 if cpu["raw"] else float("nan"),
    }


async def ab_throughput(ours: Op, raw: Op, ops: int, concurrency: int, rounds: int = 21) -> dict[str, float]:
    """Ops/s with ``concurrency`` tasks doing ``ops`` ops per round, in back-to-back pairs of rounds
    that alternate which side goes first; plus this process's CPU per op (µs). The ratios are the
    median of the per-pair ratios: other load on a shared machine drifts over seconds and hits both
    rounds of a pair alike, where it would skew a ratio of medians."""

    async def run(op: Op) -> tuple[float, float]:
        per_task = ops // concurrency

        async def task() -> None:
            for _ in range(per_task):
                await op()

        c0 = time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(task() for _ in range(concurrency)))
        done = per_task * concurrency
        return done / (time.perf_counter() - t0), (time.process_time() - c0) / done * 1e6

    pairs: list[tuple[tuple[float, float], tuple[float, float]]] = []
    for i in range(rounds):
        if i % 2 == 0:
            a = await run(ours)
            b = await run(raw)
        else:
            b = await run(raw)
            a = await run(ours)
        pairs.append((a, b))
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {
        "ours_ops_s": med([a[0] for a, _ in pairs]),
        "raw_ops_s": med([b[0] for _, b in pairs]),
        "throughput_ratio": med([a[0] / b[0] for a, b in pairs]),
        "ours_cpu_us": med([a[1] for a, _ in pairs]),
        "raw_cpu_us": med([b[1] for _, b in pairs]),
        "cpu_overhead_pct": (med([a[1] / b[1] for a, b in pairs]) - 1) * 100,
    }
