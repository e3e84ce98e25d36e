"""A rewritten report keeps the Earlier runs section of the one it replaces."""

from __future__ import annotations

from pathlib import Path

from benchmarks import earlier_runs

OLD = """# Bench

old numbers

## Earlier runs

| run | tok/s |
|---|---:|
| 2026-01-01 | 5 |

## Something after
text
"""


def test_the_section_is_found_up_to_the_next_heading() -> None:
    assert earlier_runs.section(OLD) == "## Earlier runs\n\n| run | tok/s |\n|---|---:|\n| 2026-01-01 | 5 |\n"
    assert earlier_runs.section("# Bench\n\nno history\n") is None


def test_a_new_report_keeps_the_old_section_and_a_report_with_its_own_keeps_that(tmp_path: Path) -> None:
    path = tmp_path / "bench.md"
    earlier_runs.write(path, "# Bench\n\nfirst\n")  # nothing to keep
    assert path.read_text() == "# Bench\n\nfirst\n"
    path.write_text(OLD)
    earlier_runs.write(path, "# Bench\n\nnew numbers\n")
    kept = earlier_runs.section(OLD)
    assert kept is not None and path.read_text() == "# Bench\n\nnew numbers\n\n" + kept
    own = "# Bench\n\n## Earlier runs\n\n| run | tok/s |\n|---|---:|\n| 2026-02-01 | 6 |\n"
    earlier_runs.write(path, own)
    assert path.read_text() == own
