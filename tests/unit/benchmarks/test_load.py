"""The load generator: arrival schedules, workload mixes, loop bounds, percentiles, the summary."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time

import pytest

from benchmarks.load.generator import (
    SHORT_PROMPTS,
    Result,
    WorkItem,
    Workload,
    closed_loop,
    make_items,
    open_loop,
    poisson_schedule,
    summarize,
)
from benchmarks.stats import percentile


def test_poisson_schedule_has_the_rate_and_exponential_gaps() -> None:
    arrivals = poisson_schedule(50.0, 200.0, 1_000_000, random.Random(42))
    # 10,000 expected arrivals; a Poisson count's standard deviation is 100.
    assert abs(len(arrivals) - 10_000) < 400
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 200.0
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 50, rel=0.04)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert poisson_schedule(50.0, 200.0, 1_000_000, random.Random(42)) == arrivals  # seeded: reproducible


def test_poisson_schedule_is_bounded_by_count_and_duration() -> None:
    assert len(poisson_schedule(1000.0, 60.0, 25, random.Random(1))) == 25
    assert all(t < 0.5 for t in poisson_schedule(10.0, 0.5, 10_000, random.Random(1)))
    with pytest.raises(ValueError, match="rate"):
        poisson_schedule(0.0, 1.0, 1, random.Random(1))


def test_items_follow_the_mix_and_cache_hit_ratio() -> None:
    workload = Workload(short=0.5, long=0.3, chat=0.2, cache_hit_ratio=0.3, max_tokens=9, chat_turns=3)
    items = make_items(workload, 4000, random.Random(5))
    kinds = {k: sum(i.kind == k for i in items) / len(items) for k in ("short", "long", "chat")}
    assert kinds == pytest.approx({"short": 0.5, "long": 0.3, "chat": 0.2}, abs=0.03)
    hits = [i for i in items if i.cacheable]
    assert len(hits) / len(items) == pytest.approx(0.3, abs=0.03)
    # Repeats come from a small fixed set; every other request is unique.
    assert len({i.messages for i in hits}) < 40
    misses = [i.messages for i in items if not i.cacheable]
    assert len(set(misses)) == len(misses)
    assert all(i.max_tokens == 9 for i in items)
    short = next(i for i in hits if i.kind == "short")
    assert short.messages[0][1] in SHORT_PROMPTS
    chat = next(i for i in items if i.kind == "chat")
    assert chat.messages[0][0] == "system" and chat.messages[-1][0] == "user"
    assert make_items(workload, 50, random.Random(5)) == items[:50]


def test_tags_keep_runs_apart_in_the_response_cache() -> None:
    workload = Workload(cache_hit_ratio=0.0)
    a = make_items(workload, 20, random.Random(1), tag="a-")
    b = make_items(workload, 20, random.Random(1), tag="b-")
    assert [i.kind for i in a] == [i.kind for i in b]
    assert not {i.messages for i in a} & {i.messages for i in b}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"short": 0.0}, "fractions"),
        ({"short": -1.0}, "fractions"),
        ({"cache_hit_ratio": 1.5}, "cache-hit-ratio"),
        ({"max_tokens": 0}, "max-tokens"),
    ],
)
def test_workload_rejects_bad_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Workload(**kwargs)  # type: ignore[arg-type]


class FakeServer:
    """A sender that records how many requests were in flight at once."""

    def __init__(self, hold_s: float = 0.002) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.started: list[float] = []
        self.seen: list[WorkItem] = []
        self.hold_s = hold_s

    async def __call__(self, item: WorkItem) -> Result:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.started.append(time.perf_counter())
        self.seen.append(item)
        try:
            await asyncio.sleep(self.hold_s)
            return Result(item.kind, ttft=0.001, token_times=[0.001, 0.002], tokens=2, total=self.hold_s, route="cache")
        finally:
            self.in_flight -= 1


def _items(n: int) -> list[WorkItem]:
    return make_items(Workload(), n, random.Random(0), tag="t-")


async def test_closed_loop_keeps_exactly_its_concurrency() -> None:
    server = FakeServer()
    items = _items(60)
    results, wall = await closed_loop(server, items, 4, duration_s=60.0)
    assert server.max_in_flight == 4
    assert len(results) == 60 and sorted(server.seen, key=items.index) == items  # each item once
    assert wall > 0


async def test_closed_loop_stops_at_its_duration() -> None:
    server = FakeServer(hold_s=0.01)
    results, _wall = await closed_loop(server, _items(10_000), 2, duration_s=0.1)
    assert 0 < len(results) < 10_000
    with pytest.raises(ValueError, match="concurrency"):
        await closed_loop(server, _items(1), 0, 1.0)


async def test_open_loop_starts_each_request_at_its_arrival() -> None:
    server = FakeServer()
    arrivals = [0.0, 0.02, 0.04, 0.06]
    t0 = time.perf_counter()
    results, _wall = await open_loop(server, _items(4), arrivals)
    assert len(results) == 4 and all(r.status == "OK" for r in results)
    for arrival, started in zip(arrivals, sorted(server.started), strict=True):
        assert started - t0 >= arrival - 0.005  # never early (the event loop's clock is coarse)
    assert all(r.queued >= 0 for r in results)


async def test_a_hung_request_ends_as_a_client_timeout() -> None:
    async def hang(item: WorkItem) -> Result:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    results, _wall = await closed_loop(hang, _items(2), 2, 60.0, timeout_s=0.05)
    assert [r.status for r in results] == ["CLIENT_TIMEOUT", "CLIENT_TIMEOUT"]


def test_percentile_interpolates_linearly() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 95) == 3.0


def test_summary_counts_latency_throughput_errors_and_routes() -> None:
    results = [
        Result("short", ttft=i / 1000, token_times=[i / 1000, (i + 2) / 1000], tokens=2, total=(i + 2) / 1000,
               route="edge/edge-0" if i % 2 else "cache")
        for i in range(1, 101)
    ]  # fmt: skip
    results += [Result("chat", status="RESOURCE_EXHAUSTED"), Result("chat", status="UNAVAILABLE")]
    s = summarize(results, wall_s=10.0)
    assert s["requests"] == 102 and s["ok"] == 100
    assert s["ttft_ms_p50"] == pytest.approx(50.5) and s["ttft_ms_p99"] == pytest.approx(99.01)
    assert s["itl_ms_p50"] == pytest.approx(2.0)
    assert s["e2e_ms_p95"] == pytest.approx(97.05)
    assert s["requests_per_s"] == 10.0 and s["tokens_per_s"] == 20.0
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 1}
    assert s["routes"] == {"cache": 50, "edge/edge-0": 50} and s["cache_hit_share"] == 0.5
    assert s["kinds"] == {"chat": 2, "short": 100}
