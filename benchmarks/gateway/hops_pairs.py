"""Latency summaries for :mod:`benchmarks.gateway.hops`, and its paired phase: each path against the direct call.

**Why a paired phase.** In the round robin (every path in turn, request by request) the worker serves
every request, whatever the path, while a hop's process (router, gateway) serves one request in eight
and idles in between. On this machine a process that has idled is measurably slower to wake and to
run: its caches and its virtual CPU have gone cold (docs/gateway.md, *Warm and cold hops*). So the
round robin's "added" is the hop's cost *with the hop cold and the baseline warm*. The paired phase
measures each path alone against the direct call, alternating the two request by request (which goes
first in each pair is seeded-random), so the hop's process serves every other request, as under
steady traffic, and both sides of the subtraction are equally warm. The report gives both.

:func:`ab_paired` does the same over two meshes from two source trees at once (``--ab-tree``), their
pairs interleaved round by round in a random order, each against its own tree's direct call.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

from benchmarks.stats import percentile

Sample = tuple[float, float, int]
"""One request: (TTFT s, total s, frames with tokens)."""
Probe = Callable[[], Awaitable[Sample]]


def summary(samples: list[Sample], base: list[Sample] | None) -> dict[str, float]:
    """p50/p99 of TTFT and total time (ms); with ``base``, also each minus ``base``'s (the added time)."""
    ttft = [s[0] * 1000 for s in samples]
    total = [s[1] * 1000 for s in samples]
    row = {
        "requests": len(samples),
        "frames": samples[0][2] if samples else 0,
        "ttft_p50_ms": round(percentile(ttft, 50), 3),
        "ttft_p99_ms": round(percentile(ttft, 99), 3),
        "total_p50_ms": round(percentile(total, 50), 3),
        "total_p99_ms": round(percentile(total, 99), 3),
    }
    if base is not None:
        b_ttft = [s[0] * 1000 for s in base]
        b_total = [s[1] * 1000 for s in base]
        row["added_ttft_p50_ms"] = round(row["ttft_p50_ms"] - percentile(b_ttft, 50), 3)
        row["added_ttft_p99_ms"] = round(row["ttft_p99_ms"] - percentile(b_ttft, 99), 3)
        row["added_total_p50_ms"] = round(row["total_p50_ms"] - percentile(b_total, 50), 3)
        row["added_total_p99_ms"] = round(row["total_p99_ms"] - percentile(b_total, 99), 3)
        frames = max(1, int(row["frames"]) - 1)
        row["relay_us_per_frame"] = round((row["added_total_p50_ms"] - row["added_ttft_p50_ms"]) * 1000 / frames, 1)
    return row


async def paired(
    probes: dict[str, Probe], base: str, requests: int, warmup: int = 20, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Each path of ``probes`` but ``base``, in turn, alternated request by request with ``base``:
    ``requests`` pairs per path (after ``warmup`` pairs), the order within a pair seeded-random.
    Per path: its summary against the ``base`` samples of its own pairs, plus ``base_ttft_p50_ms``."""
    rng = random.Random(seed)
    out: dict[str, dict[str, float]] = {}
    for name, probe in probes.items():
        if name == base:
            continue
        pair = [(base, probes[base]), (name, probe)]
        for _ in range(warmup):
            for _label, call in pair:
                await call()
        samples: dict[str, list[Sample]] = {base: [], name: []}
        for _ in range(requests):
            rng.shuffle(pair)
            for label, call in pair:
                samples[label].append(await call())
        row = summary(samples[name], samples[base])
        row["base_ttft_p50_ms"] = summary(samples[base], None)["ttft_p50_ms"]
        out[name] = row
    return out


async def ab_paired(
    sides: dict[str, dict[str, Probe]], base: str, requests: int, warmup: int = 20, seed: int = 0
) -> dict[str, dict[str, dict[str, float]]]:
    """The paired method over two (or more) meshes at once, for an A/B of two source trees: every
    side has the same path names, ``base`` (its direct call) among them. Each path in turn, as in
    :func:`paired`; per round, the sides in a seeded-random order, each running one pair of its own
    ``base`` and the path (the order within the pair seeded-random too), so both trees' requests are
    interleaved under the same machine load. Per side and path: the summary against that side's own
    ``base`` samples, ``base_ttft_p50_ms``, and ``pair_ttft_p50_ms`` (median of the per-pair TTFT
    differences)."""
    rng = random.Random(seed)
    names = [name for name in next(iter(sides.values())) if name != base]
    out: dict[str, dict[str, dict[str, float]]] = {side: {} for side in sides}
    for name in names:
        order = list(sides)
        pairs = {side: [(base, probes[base]), (name, probes[name])] for side, probes in sides.items()}
        for _ in range(warmup):
            for side in order:
                for _label, call in pairs[side]:
                    await call()
        samples: dict[str, dict[str, list[Sample]]] = {side: {base: [], name: []} for side in sides}
        for _ in range(requests):
            rng.shuffle(order)
            for side in order:
                rng.shuffle(pairs[side])
                for label, call in pairs[side]:
                    samples[side][label].append(await call())
        for side, got in samples.items():
            row = summary(got[name], got[base])
            row["base_ttft_p50_ms"] = summary(got[base], None)["ttft_p50_ms"]
            diffs = [(a[0] - b[0]) * 1000 for a, b in zip(got[name], got[base], strict=True)]
            row["pair_ttft_p50_ms"] = round(percentile(diffs, 50), 3)
            out[side][name] = row
    return out
