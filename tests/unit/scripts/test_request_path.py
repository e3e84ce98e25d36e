"""scripts/request_path.py's report: which files count, how they are grouped and what is excluded (the
measurement itself starts real processes and runs by hand: `python scripts/request_path.py`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "request_path.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("request_path", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["request_path"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_only_files_under_the_measured_trees_services_count(tmp_path: Path) -> None:
    rp = load()
    rows = [
        [str(tmp_path / "services/gateway/servicer.py"), "GatewayServicer.Generate", 1.0],
        [str(tmp_path / "services/gateway/servicer.py"), "GatewayServicer._admit", 1.1],
        [str(tmp_path / "benchmarks/x.py"), "f", 1.0],
        ["/elsewhere/services/gateway/servicer.py", "GatewayServicer.Generate", 1.0],
        ["/usr/lib/python3.11/asyncio/events.py", "Handle._run", 1.0],
    ]
    recorded = rp.Recorded.from_rows(tmp_path, rows)
    assert recorded.functions == {
        "services/gateway/servicer.py": ["GatewayServicer.Generate", "GatewayServicer._admit"]
    }


def test_files_first_called_after_the_first_token_are_set_apart(tmp_path: Path) -> None:
    rp = load()
    rows = [
        [str(tmp_path / "services/router/balancer/core.py"), "RouterCore.generate", 1.0],
        [str(tmp_path / "services/router/balancer/core.py"), "RouterCore._finish", 3.0],  # same file: still counted
        [str(tmp_path / "services/store/response_codec.py"), "encode_response", 2.5],
    ]
    recorded = rp.Recorded.from_rows(tmp_path, rows, cutoff=2.0)
    assert recorded.files == {"services/router/balancer/core.py"}
    assert recorded.late == {"services/store/response_codec.py": ["encode_response"]}
    report = rp.summarize("/tree", "abc123", {"gateway": recorded}, {})
    assert report["total_files"] == 1
    assert report["after_first_token_files"] == ["services/store/response_codec.py"]
    assert "`services/store/response_codec.py`" in rp.render_markdown(report)


def test_report_counts_each_file_once_and_excludes_infrastructure() -> None:
    rp = load()
    gateway = rp.Recorded(
        {
            "services/gateway/servicer.py": ["a"],
            "services/common/tracing.py": ["b"],
            "services/common/pb/meshserve/v1/inference_pb2_grpc.py": ["c"],
            "services/router/balancer/core.py": ["d"],
        }
    )
    worker = rp.Recorded(
        {
            "services/common/tracing.py": ["b"],
            "services/edge_worker/ort_engine.py": ["e"],
            "services/worker/config.py": ["f"],
        }
    )
    idle = {"gateway": rp.Recorded({"services/router/balancer/registry.py": ["g"]}), "worker": rp.Recorded()}
    report = rp.summarize("/tree", "abc123", {"gateway": gateway, "worker": worker}, idle)
    assert report["total_files"] == 6  # tracing.py is in both processes and counts once
    assert report["files_excluding_infrastructure"] == 3
    assert report["infrastructure"] == [
        "services/common/pb/meshserve/v1/inference_pb2_grpc.py",
        "services/common/tracing.py",
        "services/worker/config.py",
    ]
    assert report["sides"]["gateway"]["files"] == 4
    assert report["sides"]["gateway"]["files_excluding_infrastructure"] == 2
    assert report["sides"]["gateway"]["by_package"] == {
        "services/common": ["tracing.py"],
        "services/common/pb": ["inference_pb2_grpc.py"],
        "services/gateway": ["servicer.py"],
        "services/router/balancer": ["core.py"],
    }
    assert report["idle_window_files"] == ["services/router/balancer/registry.py"]
    assert report["request_files_also_seen_idle"] == []

    text = rp.render_markdown(report)
    assert "Total files (both processes, each file once): 6" in text
    assert "Files excluding cross-cutting infrastructure: 3" in text
    assert "## gateway process: 4 files (2 excluding infrastructure)" in text
    assert "- `services/edge_worker/`: ort_engine.py" in text
