"""The batch benchmark's report: pooled phases, per-round rows, the load average and the TARGET line."""

from __future__ import annotations

from benchmarks.batch.priority import report, target_line


def result(rise: float, status: str = "completed", control: bool = False) -> dict[str, object]:
    phase = {"n": 40, "errors": 0, "p50_ms": 200.0, "p99_ms": 500.0}
    return {
        "rate_rps": 2.0,
        "seconds_per_phase": 120.0,
        "rounds": 1,
        "interactive_max_tokens": 16,
        "edge_workers": 2,
        "batch_lines": 400,
        "batch_max_tokens": 16,
        "runner_max_in_flight": 4,
        "admission": "headroom",
        "control": control,
        "runner_env": ["HEADROOM_MAX_DEFER_S=60"],
        "baseline": phase,
        "with_batch": phase,
        "per_round": [{"baseline": phase, "with_batch": phase, "batch_lines_done": 3}],
        "batch_lines_done_during_phase": 3,
        "batch_status": status,
        "batch_completed": 400,
        "batch_failed": 0,
        "batch_seconds": 300.0,
        "rise": rise,
        "p50_rise": 0.0,
        "load_average": {"before": 1.5, "after_phases": 2.0, "end": 1.8},
        "date": "2026-11-27 07:00 UTC",
        "host": "x86_64, 3.11",
    }


def test_the_target_needs_the_rise_within_bound_and_the_batch_finished() -> None:
    assert target_line(0.05, True).endswith("PASS")
    assert target_line(0.15, True).endswith("FAIL")
    assert target_line(0.05, False).endswith("FAIL")


def test_the_report_names_the_load_the_rounds_and_a_control_run() -> None:
    text = report(result(0.05), "meshserve bench batch")
    assert "load average 1.50 before" in text and "| 1 | 40 | 200 | 500 | 40 | 200 | 500 | 3 |" in text
    assert "HEADROOM_MAX_DEFER_S=60" in text and "TARGET batch_interactive_ttft_p99_rise: 0.050" in text
    assert "CONTROL" in report(result(0.05, control=True), "x")
    assert report(result(0.05, status="in_progress"), "x").rstrip().endswith("FAIL\n```")
