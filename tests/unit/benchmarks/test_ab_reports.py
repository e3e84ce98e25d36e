"""The A/B reports of hops and relay put both trees' numbers side by side and say when a run is A/A."""

from __future__ import annotations

from typing import Any

from benchmarks.gateway import hops_ab, relay_ab

TREES = {
    "a": {"path": "/work/tree", "commit": "abc1234+changes", "services": "5e7f001"},
    "b": {"path": "/tmp/before", "commit": "04ec40b", "services": "5e7f001"},
}


def _hop(added: float, base: float = 2.0) -> dict[str, float]:
    return {
        "base_ttft_p50_ms": base,
        "ttft_p50_ms": base + added,
        "ttft_p99_ms": base + added + 1,
        "added_ttft_p50_ms": added,
        "added_ttft_p99_ms": added + 1,
        "added_total_p50_ms": added,
        "pair_ttft_p50_ms": added - 0.05,
    }


def test_hops_ab_report_gives_both_trees_and_their_difference() -> None:
    report: dict[str, Any] = {
        "date": "2026-11-27T00:00:00+00:00",
        "machine": {"cpus": 2, "python": "3.11.7", "load_avg_1m": 3.0},
        "command": "python -m benchmarks.gateway.hops --ab-tree /tmp/before",
        "trees": TREES,
        "a_a": True,
        "max_tokens": 16,
        "notes": [],
        "paired": {"a": {"gateway_embedded_router": _hop(1.2)}, "b": {"gateway_embedded_router": _hop(1.5, 2.1)}},
        "cpu_ms_per_request": {
            side: {"gateway_embedded_router": {"client": 1.0, "gateway_embedded": 2.5, "worker": 1.0}}
            for side in ("a", "b")
        },
        "cache_hit": {side: {"gateway_embedded_router": _hop(0.0, 1.5)} for side in ("a", "b")},
    }
    text = hops_ab.markdown(report)
    assert "A/A: both sides run the same service code" in text
    assert "`/tmp/before` @ 04ec40b (services/ tree 5e7f001)" in text
    row = "| gateway_embedded_router | 2.00 / 2.10 | +1.20 / +1.50 | **+0.30** | +1.15 / +1.45 | +0.30 |"
    assert row in text
    assert "| gateway_embedded_router | 1.00 / 1.00 | 0.00 / 0.00 | 0.00 / 0.00 | 2.50 / 2.50 |" in text
    report["a_a"] = False
    assert "A/B: two source trees" in hops_ab.markdown(report)


def test_relay_ab_report_gives_both_trees_tokens_per_second() -> None:
    def medians(tok_s: float) -> dict[str, float]:
        return {"tokens_per_s": tok_s, "frames_per_token": 0.5, "e2e_ms_p50": 40.0, "hops_cpu_ms_per_1k_tokens": 150.0}

    mode = {
        "token_interval_ms": 5.0,
        "offered_tokens_per_s": 6400,
        "medians": {"a": {"gateway_embedded_router": medians(6000)}, "b": {"gateway_embedded_router": medians(5400)}},
    }
    report = {
        "date": "2026-11-27T00:00:00+00:00",
        "machine": {"cpus": 2, "load_avg_1m": 3.0},
        "command": "meshserve bench relay --ab-tree /tmp/before",
        "trees": TREES,
        "a_a": False,
        "streams": 32,
        "max_tokens": 256,
        "target_tokens_per_s": 5000.0,
        "notes": ["a note"],
        "modes": {"paced": mode},
    }
    text = relay_ab.markdown(report)
    assert "| gateway_embedded_router | 6,000 / 5,400 | 0.900 | 0.50 / 0.50 | 40.0 / 40.0 | 150 / 150 |" in text
    assert "A/B: two source trees" in text and "a note" in text
