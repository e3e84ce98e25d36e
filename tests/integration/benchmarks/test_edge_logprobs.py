"""benchmarks/edge/logprobs.py on the real INT4 model, tiny: both variants produce the same tokens, the
variant's frames are bigger (they carry the logprobs), and it writes the TARGET line to its page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.edge.logprobs import main

pytestmark = pytest.mark.integration


def test_the_benchmark_runs_and_reports_its_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--streams", "2", "--max-tokens", "4", "--repeats", "1", "--threads", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    assert "TARGET per-token CPU with top_logprobs=5 vs without at 2 streams" in capsys.readouterr().out
    page = (tmp_path / "edge_logprobs.md").read_text()
    assert "TARGET" in page and "load average" in page

    report = json.loads((tmp_path / "edge_logprobs.json").read_text())["results"]
    base, variant = report["baseline"], report["top_logprobs=5"]
    assert base["tokens"] == variant["tokens"] == 8
    assert variant["frame_bytes_per_token"] > base["frame_bytes_per_token"] + 50
