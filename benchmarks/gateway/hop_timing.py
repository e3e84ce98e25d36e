"""How the hop benchmarks time one request and read a process's CPU: the measures that
:mod:`benchmarks.gateway.hops` (this tree's mesh) and :mod:`benchmarks.gateway.hops_ab` (two trees' meshes)
share, and the CPU clock the other mesh benchmarks read (relay, vs_litellm, the worker A/B runs).

One request is a greedy stream through a gateway or router (:func:`stream_call`) or straight to a
worker's internal ``Generate`` (:func:`worker_call`); both give (TTFT s, total s, frames with tokens).
CPU is every thread's time from /proc schedstat (ns, exact, not 10 ms ticks).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from benchmarks.gateway.hops_pairs import Probe
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import worker_pb2

PROMPT = "Write a short poem about the sea and the ships that sail on it."
INTERNAL = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN), ("x-meshserve-tenant", "bench"))
"""Metadata of a call on the internal API (router, worker)."""


async def stream_call(call: AsyncIterator[Any]) -> tuple[float, float, int]:
    """One public ``Generate`` stream read to its final frame: (TTFT s, total s, frames with tokens)."""
    start = time.perf_counter()
    first = float("nan")
    frames = 0
    async for frame in call:
        if frame.token_ids:
            frames += 1
            if frames == 1:
                first = time.perf_counter() - start
        if frame.HasField("final"):
            break
    return first, time.perf_counter() - start, frames


async def worker_call(stub: Any, start: worker_pb2.WorkerRequest) -> tuple[float, float, int]:
    """One request straight to a worker's internal Generate: (TTFT s, total s, frames with tokens)."""
    t0 = time.perf_counter()
    call = stub.Generate(metadata=INTERNAL)
    await call.write(start)
    first, frames = float("nan"), 0
    try:
        while True:
            frame = await call.read()
            if frame.token_ids:
                frames += 1
                if frames == 1:
                    first = time.perf_counter() - t0
            if frame.HasField("final"):
                break
    finally:
        call.cancel()
    return first, time.perf_counter() - t0, frames


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` in ns (/proc schedstat: exact, not 10 ms ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total


async def latency_samples(
    probes: dict[str, Probe], requests: int, warmup: int
) -> dict[str, list[tuple[float, float, int]]]:
    """``requests`` timings of every probe, each round in a new seeded order (no path always follows the
    same one), after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for probe in probes.values():
            await probe()
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in probes}
    order, rng = list(probes), random.Random(0)
    for _ in range(requests):
        rng.shuffle(order)
        for name in order:
            samples[name].append(await probes[name]())
    return samples


async def cpu_per_request(
    probes: dict[str, Probe], pids: dict[str, int], requests: int, block: int = 10
) -> dict[str, dict[str, float]]:
    """CPU ms per request of every process of ``pids``, per path: blocks of ``block`` requests of
    each path in turn (interleaved like the latency run, so every path sees the same machine load)."""
    spent: dict[str, dict[str, int]] = {path: dict.fromkeys(pids, 0) for path in probes}
    for probe in probes.values():
        for _ in range(block):
            await probe()
    for _ in range(max(1, requests // block)):
        for path, probe in probes.items():
            before = {n: cpu_ns(pid) for n, pid in pids.items()}
            for _ in range(block):
                await probe()
            for n, pid in pids.items():
                spent[path][n] += cpu_ns(pid) - before[n]
    done = max(1, requests // block) * block
    return {path: {n: round(ns / done / 1e6, 3) for n, ns in row.items()} for path, row in spent.items()}
