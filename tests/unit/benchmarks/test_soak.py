"""Soak verdict: growth between the post-warm-up baseline window and the final window; sampling."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from benchmarks.load.soak import Samples, fd_change, growth, redis_summary, sample, service_processes, verdict
from benchmarks.load.soak_report import markdown


def _series(values: list[float], step: float = 5.0) -> list[tuple[float, float]]:
    return [(i * step, v) for i, v in enumerate(values)]


def test_cold_start_growth_is_not_counted() -> None:
    # Memory climbs while warming up (first minute), then stays flat: no growth.
    values = [100.0 + 10 * i for i in range(12)] + [220.0] * 108
    row = growth(_series(values), warmup_s=120.0, window_s=60.0)
    assert row == {"baseline": 220.0, "final": 220.0, "growth_pct": 0.0}


def test_second_half_growth_tells_a_leak_from_a_high_water_mark() -> None:
    leak = _series([200.0 + 0.2 * i for i in range(120)])
    step = _series([200.0] * 40 + [220.0] * 80)  # one jump in the first half, flat afterwards
    rows = verdict({"leak": leak, "step": step}, 60.0, 60.0, 5.0)["series"]
    assert rows["step"]["growth_pct"] == 10.0 and rows["step"]["second_half_growth_pct"] == 0.0
    assert rows["leak"]["second_half_growth_pct"] > 2.0


def test_steady_leak_is_caught() -> None:
    values = [200.0 + 0.2 * i for i in range(120)]  # +0.2 MB every 5 s for 10 minutes
    row = growth(_series(values), warmup_s=120.0, window_s=60.0)
    assert row["growth_pct"] > 5.0
    result = verdict({"gateway/rss_mb": _series(values), "router/fds": _series([30.0] * 120)}, 120.0, 60.0, 5.0)
    assert result["grew"] == ["gateway/rss_mb"] and not result["pass"]
    assert result["series"]["router/fds"]["growth_pct"] == 0.0


def test_growth_within_the_limit_passes() -> None:
    values = [100.0] * 60 + [104.0] * 60
    assert verdict({"worker/rss_mb": _series(values)}, 60.0, 60.0, 5.0)["pass"]


def test_sampling_reads_rss_and_fds_of_child_processes() -> None:
    code = "import sys, time; print('up', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        # sampled once Python runs, not mid-exec (an RSS of 0.2 MB then)
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        procs = service_processes({child.pid: "sleeper"})
        assert procs["sleeper"].pid == child.pid
        samples: Samples = {}
        sample({"sleeper": procs["sleeper"], "me": psutil.Process(os.getpid())}, 0.0, samples)
        assert samples["sleeper/rss_mb"][0][1] > 1.0 and samples["sleeper/fds"][0][1] >= 3
        assert samples["me/fds"][0][1] >= 3
    finally:
        child.kill()
        child.communicate()


def test_soak_markdown_states_the_verdict() -> None:
    summary = {"requests": 10, "ok": 10, "errors": {}, "routes": {"cache": 2}, "requests_per_s": 1.0}
    summary |= {"tokens_per_s": 16.0, "ttft_ms_p50": 5.0, "ttft_ms_p99": 9.0, "e2e_ms_p50": 50.0, "e2e_ms_p99": 90.0}
    report = {
        "date": "2026-01-01",
        "machine": {"cpus": 2, "load_avg_1m": 1.0},
        "command": "meshserve bench soak --minutes 1",
        "workload": {"short": 1, "long": 0, "chat": 0, "cache_hit_ratio": 0.2, "max_tokens": 16},
        "capacity": {"steps": [{"concurrency": 1, "summary": summary}], "requests_per_s": 1.0},
        "load_fraction": 0.8,
        "rate_requests_per_s": 0.8,
        "minutes": 1,
        "warmup_s": 12.0,
        "window_s": 6.0,
        "interval_s": 5.0,
        "summary": summary,
        "verdict": verdict({"gateway/rss_mb": _series([100.0] * 4 + [120.0] * 8)}, 0.0, 15.0, 5.0),
    }
    text = markdown(report)
    assert (
        "**FAIL** (grew: gateway/rss_mb)" in text
        and "| gateway/rss_mb | 100.0 | 120.0 | +20.00 | +0.00 | grew |" in text
    )


def test_soak_markdown_shows_redis_at_its_bound_and_which_fds_changed() -> None:
    summary = {"requests": 10, "ok": 10, "errors": {}, "routes": {"cache": 2}, "requests_per_s": 1.0}
    summary |= {"tokens_per_s": 16.0, "ttft_ms_p50": 5.0, "ttft_ms_p99": 9.0, "e2e_ms_p50": 50.0, "e2e_ms_p99": 90.0}
    cap = 32.0 * 2**20
    redis = {
        "used_memory": [(0.0, 0.5 * cap), (60.0, 0.97 * cap), (120.0, 0.98 * cap)],
        "maxmemory": [(t, cap) for t in (0.0, 60.0, 120.0)],
        "used_memory_rss": [(t, 40.0 * 2**20) for t in (0.0, 60.0, 120.0)],
        "evicted_keys": [(0.0, 0.0), (60.0, 10.0), (120.0, 70.0)],
        "keys": [(t, 90.0) for t in (0.0, 60.0, 120.0)],
        "connected_clients": [(t, 20.0) for t in (0.0, 60.0, 120.0)],
    }
    kinds = [
        (0.0, {"pipe": 2}),
        (60.0, {"pipe": 2, "tcp->redis-server": 3}),
        (120.0, {"pipe": 2, "tcp->redis-server": 4}),
    ]
    report = {
        "date": "2026-01-01",
        "machine": {"cpus": 2, "load_avg_1m": 1.0},
        "command": "meshserve bench soak --minutes 2",
        "workload": {"short": 1, "long": 0, "chat": 0, "cache_hit_ratio": 0.2, "max_tokens": 16},
        "capacity": {"steps": [{"concurrency": 1, "summary": summary}], "requests_per_s": 1.0},
        "fill": {"requests": 2548, "chat": 48, "concurrency": 16, "wall_s": 100.0, "errors": {}},
        "redis_maxmemory": "32mb",
        "load_fraction": 0.8,
        "rate_requests_per_s": 0.8,
        "minutes": 2,
        "warmup_s": 60.0,
        "window_s": 12.0,
        "interval_s": 5.0,
        "summary": summary,
        "verdict": verdict({"cloud-0/fds": _series([20.0] * 12 + [21.0] * 13)}, 60.0, 12.0, 5.0),
        "redis": redis_summary(redis, 60.0),
        "redis_clients": [(0.0, {"gateway": 15}), (120.0, {"gateway": 15, "cloud-0": 4})],
        "fd_kinds": {"cloud-0": fd_change(kinds, 60.0), "router": fd_change([(0.0, {"pipe": 2})], 60.0)},
        "threads": {"cloud-0": growth(_series([20.0] * 12 + [23.0] * 13), 50.0, 12.0)},
        "log_events": [
            {"phase": "fill", "service": "router", "level": "warning", "event": "worker_ejected", "count": 3},
            {"phase": "stop", "service": "router", "level": "warning", "event": "shutdown_slow", "count": 1},
        ],
    }
    text = markdown(report)
    assert "reached 95 % of maxmemory at 60 s, before the baseline window; 60 keys evicted" in text
    assert "| final | 31.4 | 32.0 | 40.0 | 70 | 90 | 20 |" in text
    assert "| cloud-0 | pipe 2, tcp->redis-server 4 | tcp->redis-server 3 → 4 | 20 → 23 |" in text
    assert "| router | pipe 2 | no change |  |" in text
    assert "| fill | router | warning | worker_ejected | 3 |" in text and "shutdown_slow" not in text
    assert "Raw samples: `docs/benchmarks/soak.json`" in text
    assert "Raw samples: `/tmp/x/soak.json`" in markdown(report | {"json_path": "/tmp/x/soak.json"})
    quiet = markdown(report | {"log_events": report["log_events"][1:]})
    assert "logged no warning or error during the ramp, the fill and the soak" in quiet
    assert "120 s: cloud-0 4, gateway 15" in text and "2500 distinct one-token prompts and 48 chat turns" in text
