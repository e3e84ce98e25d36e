"""What an edge worker's process imports to serve: not ``onnx`` (the graph edit, only on a load-cache
miss: services/edge_worker/graph_edit.py) and not ``onnxruntime_genai`` (only for ``engine: og``), so a
sleeping worker keeps neither resident (scale from zero, docs/deploy.md)."""

from __future__ import annotations

import subprocess
import sys


def test_the_edge_workers_serving_code_imports_neither_onnx_nor_onnxruntime_genai() -> None:
    code = (
        "import sys\n"
        "import services.edge_worker.__main__, services.edge_worker.server, services.edge_worker.graph\n"
        "print(sorted(m for m in ('onnx', 'onnxruntime_genai') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
