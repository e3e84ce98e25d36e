"""The hop benchmark's report judges issue 3's target per gateway layout from the measured numbers."""

from __future__ import annotations

from benchmarks.gateway.hops_report import markdown


def _row(ttft_p50: float, added_p50: float | None = None, added_p99: float | None = None) -> dict[str, float]:
    row = {
        "ttft_p50_ms": ttft_p50,
        "ttft_p99_ms": ttft_p50 + 1,
        "total_p50_ms": ttft_p50 + 0.2,
        "total_p99_ms": ttft_p50 + 2,
    }
    if added_p50 is not None and added_p99 is not None:
        row |= {
            "added_ttft_p50_ms": added_p50,
            "added_ttft_p99_ms": added_p99,
            "added_total_p50_ms": added_p50,
            "added_total_p99_ms": added_p99,
            "relay_us_per_frame": 50.0,
        }
    return row


def test_targets_pass_and_fail_by_layout() -> None:
    report = {
        "date": "2026-11-22T00:00:00+00:00",
        "machine": {"cpus": 2, "python": "3.11", "load_avg_1m": 0.5},
        "command": "python -m benchmarks.gateway.hops",
        "max_tokens": 16,
        "latency": {
            "direct_worker": _row(2.0),
            "gateway_static_key": _row(4.5, 2.5, 3.0),
            "gateway_embedded_router": _row(3.2, 1.2, 6.0),
        },
        "cpu_ms_per_request": {},
        "cache_hit": {"gateway_static_key": _row(2.6), "gateway_embedded_router": _row(1.7)},
        "cache_hit_cpu_ms_per_request": {},
    }
    text = markdown(report)
    assert "`gateway_embedded_router`: +1.20 ms p50, +6.00 ms p99: **FAIL**" in text  # p99 over 5 ms
    assert "`gateway_static_key`: +2.50 ms p50, +3.00 ms p99: **FAIL**" in text
    assert "best 1.70 ms (`gateway_embedded_router`)" in text
    report["latency"]["gateway_embedded_router"] = _row(3.2, 1.2, 2.0)
    assert "`gateway_embedded_router`: +1.20 ms p50, +2.00 ms p99: **PASS**" in markdown(report)


def test_targets_read_the_paired_numbers_when_the_run_has_them() -> None:
    report = {
        "date": "2026-11-23T00:00:00+00:00",
        "machine": {"cpus": 2, "python": "3.11"},
        "command": "python -m benchmarks.gateway.hops",
        "max_tokens": 16,
        "latency": {"direct_worker": _row(1.5), "gateway_embedded_router": _row(3.1, 1.6, 2.0)},
        "paired": {"gateway_embedded_router": _row(2.3, 0.9, 1.1) | {"base_ttft_p50_ms": 1.4}},
        "cpu_ms_per_request": {},
        "cache_hit": {"gateway_embedded_router": _row(1.7)},
        "cache_hit_cpu_ms_per_request": {},
    }
    text = markdown(report)
    assert "`gateway_embedded_router`: +0.90 ms p50, +1.10 ms p99 (round robin +1.60 / +2.00): **PASS**" in text
    assert "| gateway_embedded_router | 1.40 | 2.30 | +0.90 | +1.10 | +0.90 | +1.10 |" in text
    report["paired"]["gateway_embedded_router"]["added_ttft_p50_ms"] = 1.7
    assert "+1.70 ms p50, +1.10 ms p99 (round robin +1.60 / +2.00): **FAIL**" in markdown(report)
