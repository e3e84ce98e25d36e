"""``python -m benchmarks.cloud.gpu --device cpu --tiny``: the GPU targets run end to end on a 2-layer model.

The GPU run happens only on a lent machine (scripts/gpu_check.sh); this keeps every part of it working
in CI: the random checkpoint, the transformers anchors, the engine rows, the parity checks, the gRPC
rows against a real ``python -m services.gpu_worker`` process, and the report block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cloud import gpu as cloud_gpu
from benchmarks.cloud.gpu_targets import MARK_BEGIN, MARK_END

pytestmark = pytest.mark.integration


def test_the_tiny_cpu_run_measures_every_row_and_writes_the_targets(tmp_path: Path) -> None:
    (tmp_path / "cloud_gpu.md").write_text("# Cloud engine on a GPU\n\nEarlier runs stay.\n")
    assert cloud_gpu.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cloud_gpu_targets.json").read_text())
    assert "errors" not in report, report.get("errors")
    rows = report["shapes"]["tiny"]
    assert rows["anchor_1"]["tokens"] == 8 and rows["anchor_batch"]["batch"] == 4
    engine = rows["engine"]
    assert engine["decode_graphs"] == "static"  # the static-shape step, uncaptured on CPU
    assert engine["one"]["static_steps"] >= 7 and engine["many"]["tok_s"] > 0
    assert engine["kv_budget_respected"]
    assert engine["graph_vs_eager"]["equal"] == engine["graph_vs_eager"]["sequences"]
    assert rows["parity_fp32_vs_cpu"]["equal"] == rows["parity_fp32_vs_cpu"]["sequences"]
    assert rows["grpc"]["1"]["tokens"] == 8 and rows["grpc"]["4"]["tokens"] == 32
    names = [t["name"] for t in report["targets"]]
    assert len(names) == 5 and any("1.5x static-cache" in n for n in names)
    doc = (tmp_path / "cloud_gpu.md").read_text()
    assert doc.count(MARK_BEGIN) == 1 and doc.count(MARK_END) == 1 and "Earlier runs stay." in doc
    assert "TARGET tiny greedy fp32 cpu == CPU engine (sequences equal): 4.00 (target >= 4.00): PASS" in doc


def test_help_names_the_smoke_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cloud_gpu.main(["--help"])
    assert "--tiny" in capsys.readouterr().out
