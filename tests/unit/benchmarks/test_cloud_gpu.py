"""benchmarks/cloud/gpu.py: where two greedy runs part, and the report of a run with a failed section."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.cloud.gpu import first_diff, markdown
from benchmarks.cloud.gpu_targets import MARK_BEGIN, MARK_END, target, write_block

REPORT = Path(__file__).parents[3] / "docs" / "benchmarks" / "cloud_gpu.json"


def test_first_diff() -> None:
    assert first_diff([1, 2, 3], [1, 2, 3]) is None
    assert first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert first_diff([1, 2], [1, 2, 3]) == 2  # one stopped early (EOS): they part where it stopped


def test_markdown_of_the_committed_h100_run() -> None:
    text = markdown(json.loads(REPORT.read_text()))
    assert "| 32 | 8192 |" in text and "Single-stream decode" in text
    assert "batch_32: 24/32 equal" in text


def test_a_failed_section_is_reported_and_the_rest_still_renders() -> None:
    report = {
        "device": "cuda:0 (test)",
        "date": "today",
        "command": "python -m benchmarks.cloud.gpu",
        "dtype": "bfloat16",
        "kv_dtype": "bfloat16",
        "torch": "x",
        "model": "m",
        "errors": {"throughput": "Traceback ...\nRuntimeError: boom"},
    }
    text = markdown(report)
    assert "**throughput failed:**" in text and "RuntimeError: boom" in text


def test_the_targets_block_replaces_itself_and_keeps_the_rest(tmp_path: Path) -> None:
    doc = tmp_path / "cloud_gpu.md"
    doc.write_text("# Title\n\nOld report.\n")
    write_block(doc, f"{MARK_BEGIN}\nfirst\n{MARK_END}\n")
    write_block(doc, f"{MARK_BEGIN}\nsecond\n{MARK_END}\n")
    text = doc.read_text()
    assert text.startswith("# Title\n\n" + MARK_BEGIN) and "second" in text and "first" not in text
    assert text.count(MARK_BEGIN) == 1 and text.rstrip().endswith("Old report.")


def test_a_target_line() -> None:
    assert target("x", 2.0, 1.5)["line"] == "TARGET x: 2.00 (target >= 1.50): PASS"
    assert target("y", 1.0, 1.5)["pass"] is False
