"""``meshserve bench edge-prefill``: wired into the CLI; its report has a row per mode."""

from __future__ import annotations

from benchmarks import cli as bench_cli
from benchmarks.edge import prefill_groups


def test_edge_prefill_is_a_bench_subcommand() -> None:
    assert bench_cli.SUBCOMMANDS["edge-prefill"][0] == "benchmarks.edge.prefill_groups"


def test_the_report_has_a_row_per_mode() -> None:
    medians = {"ttft_p50_ms": 1000.0, "ttft_max_ms": 1100.0, "round_s": 1.5, "prefill_calls": 2}
    result = {
        "streams": 16,
        "prompt_tokens": 31,
        "max_tokens": 8,
        "repeats": 6,
        "medians": {"grouped": medians, "one per call": {**medians, "prefill_calls": 16}},
        "grouped_faster_rounds": 5,
    }
    text = prefill_groups.markdown(result, "meshserve bench edge-prefill", "0.50")
    assert "| grouped | 2 | 1000 | 1100 | 1.50 |" in text
    assert "| one per call | 16 |" in text and "5 of 6" in text
