"""``meshserve bench edge-n``: wired into the CLI; its report holds the table and the TARGET line."""

from __future__ import annotations

from benchmarks import cli as bench_cli
from benchmarks.edge import n_choices


def test_edge_n_is_a_bench_subcommand() -> None:
    assert bench_cli.SUBCOMMANDS["edge-n"][0] == "benchmarks.edge.n_choices"


def test_the_report_has_a_row_per_prompt_length_and_the_target_line() -> None:
    row = {
        "prompt_tokens": 256,
        "max_tokens": 32,
        "n_seconds": 1.0,
        "separate_seconds": 2.0,
        "speedup": 2.0,
        "n_cpu_s": 1.5,
        "separate_cpu_s": 3.0,
    }
    text = n_choices.markdown([row], "TARGET x: 2.00x (target >= 1.5x): PASS", "meshserve bench edge-n", "1.00")
    assert "| 256 | 32 | 1.000 | 2.000 | 2.00x |" in text
    assert "TARGET x: 2.00x (target >= 1.5x): PASS" in text and "Load average" in text
