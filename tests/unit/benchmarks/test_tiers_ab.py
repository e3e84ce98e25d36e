"""The tiers A/B benchmark's pure parts: round order, per-tree summaries, targets, the report, and the
int4 kernel probe run with the other tree's code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import cli as bench_cli
from benchmarks.report import target_line
from benchmarks.worker.tiers_ab import (
    LogTail,
    cloud_summary,
    cloud_worker_settings,
    edge_summary,
    edge_worker_settings,
    markdown,
    output_lines,
    resolved_int4_kernel,
    side_order,
    targets,
)


def _edge_sample(side: str, r: int, lone: float, og: float, top: float, llama: float | None) -> dict[str, Any]:
    return {
        "round": r, "side": side, "position": 0,
        "lone": {"decode_tokens_per_s": lone, "worker_cpu_ms_per_token": 10.0},
        "ortgenai": {"decode_tokens_per_s": og},
        "top": {"aggregate_tokens_per_s": top, "worker_cpu_ms_per_token": 4.0},
        "llamacpp": None if llama is None else {"rounds": [{"streams": 1, "aggregate_tokens_per_s": 1.0},
                                                          {"streams": 16, "aggregate_tokens_per_s": llama}]},
    }  # fmt: skip


def _cloud_sample(side: str, r: int, streams: int, tok_s: float, requests: int = 4, ok: int = 4) -> dict[str, Any]:
    return {
        "round": r, "side": side, "streams": streams, "tokens_per_s": tok_s, "worker_cpu_ms_per_token": 2.0,
        "requests": requests, "ok": ok, "tokens": 100, "wall_s": 1.0,
    }  # fmt: skip


def _edge() -> dict[str, Any]:
    samples = [
        _edge_sample("new", 1, 110.0, 100.0, 200.0, 150.0),
        _edge_sample("old", 1, 100.0, 100.0, 190.0, 150.0),
        _edge_sample("old", 2, 104.0, 98.0, 195.0, 152.0),
        _edge_sample("new", 2, 112.0, 102.0, 210.0, 151.0),
        _edge_sample("new", 3, 108.0, 100.0, 205.0, None),
        _edge_sample("old", 3, 102.0, 99.0, 185.0, 149.0),
    ]
    return {
        "engine": "batched", "threads": 2, "max_tokens": 48, "streams": 16, "rounds": 3,
        "int4_kernel": {"new": "native", "old": "native"}, "kernel_fallbacks": [],
        "llamacpp": {"model": "m", "command": "llama-batched-bench -m m"},
        "samples": samples, "summary": edge_summary(samples, 16),
    }  # fmt: skip


def _cloud() -> dict[str, Any]:
    samples = [
        _cloud_sample("new", 1, 64, 400.0), _cloud_sample("old", 1, 64, 380.0),
        _cloud_sample("old", 1, 16, 200.0), _cloud_sample("new", 1, 16, 190.0, requests=4, ok=3),
        _cloud_sample("new", 2, 64, 420.0), _cloud_sample("old", 2, 64, 400.0),
        _cloud_sample("old", 2, 16, 210.0), _cloud_sample("new", 2, 16, 200.0),
    ]  # fmt: skip
    return {
        "streams": [16, 64], "max_tokens": 64, "requests_per_stream": 2, "rounds": 2, "max_active": 64,
        "samples": samples, "summary": cloud_summary(samples),
    }  # fmt: skip


def _report(load_start: float = 0.2, load_end: float = 0.3) -> dict[str, Any]:
    tree = {"path": "/t", "commit": "abc", "services": "s1"}
    report: dict[str, Any] = {
        "date": "2026-12-02T00:00:00+00:00",
        "machine": {"cpus": 2, "platform": "Linux", "load_avg_1m_start": load_start, "load_avg_1m_end": load_end},
        "command": "meshserve bench tiers-ab --ab-tree /tmp/before",
        "trees": {"new": tree, "old": tree | {"services": "s0"}},
        "same_services": False,
        "edge": _edge(),
        "cloud": _cloud(),
    }
    report["targets"] = targets(report)
    return report


def test_the_trees_alternate_which_goes_first() -> None:
    assert [side_order(r) for r in range(4)] == [("new", "old"), ("old", "new")] * 2


def test_edge_summary_takes_each_trees_medians_and_the_references_after_it() -> None:
    summary = _edge()["summary"]
    new, old = summary["new"], summary["old"]
    assert new["rounds"] == old["rounds"] == 3
    assert new["lone_tokens_per_s"] == 110.0 and new["ortgenai_tokens_per_s"] == 100.0
    assert new["lone_vs_ortgenai"] == pytest.approx(1.10)
    assert new["top_tokens_per_s"] == 205.0
    assert new["llamacpp_tokens_per_s"] == 150.5  # the round without a llama.cpp run is left out
    assert new["top_vs_llamacpp"] == pytest.approx(205.0 / 150.5)
    assert old["lone_tokens_per_s"] == 102.0 and old["ortgenai_tokens_per_s"] == 99.0
    assert old["top_vs_llamacpp"] == pytest.approx(190.0 / 150.0)
    unmeasured = edge_summary([_edge_sample("new", 1, 100.0, 100.0, 200.0, None)], 16)["new"]
    assert unmeasured["llamacpp_tokens_per_s"] is None and unmeasured["top_vs_llamacpp"] is None


def test_cloud_summary_per_stream_count_with_failed_requests() -> None:
    summary = _cloud()["summary"]
    assert list(summary) == ["16", "64"]
    assert summary["64"]["new"]["tokens_per_s"] == 410.0 and summary["64"]["old"]["tokens_per_s"] == 390.0
    assert summary["64"]["new_vs_old"] == pytest.approx(410.0 / 390.0)
    assert summary["16"]["new"]["failed_requests"] == 1 and summary["16"]["old"]["failed_requests"] == 0
    assert summary["16"]["new_vs_old"] == pytest.approx(195.0 / 205.0)


def test_targets_new_vs_old_and_the_absolute_issue_27_ratios() -> None:
    report = _report()
    lines = [target_line(row) for row in report["targets"]]
    lone_ab = (110.0 / 100.0) / (102.0 / 99.0)
    top_ab = (205.0 / 150.5) / (190.0 / 150.0)
    assert lines == [
        f"TARGET edge_lone_stream_vs_ortgenai_new_vs_old: {lone_ab:.3f}x (target >= 1.0x): PASS",
        f"TARGET edge_16_streams_vs_llamacpp_new_vs_old: {top_ab:.3f}x (target >= 1.0x): PASS",
        "TARGET edge_single_stream_vs_ortgenai: 1.100x (target >= 1.0x): PASS",
        f"TARGET edge_16_streams_vs_llamacpp: {205.0 / 150.5:.3f}x (target >= 1.25x): PASS",
        f"TARGET cloud_16_streams_new_vs_old: {195.0 / 205.0:.3f}x (target >= 1.0x): FAIL",
        f"TARGET cloud_64_streams_new_vs_old: {410.0 / 390.0:.3f}x (target >= 1.0x): PASS",
    ]
    details = {row["name"]: row["detail"] for row in report["targets"]}
    assert (
        "new 1.100x = 110.0 / 100.0 tok/s; old 1.030x = 102.0 / 99.0 tok/s"
        in details["edge_lone_stream_vs_ortgenai_new_vs_old"]
    )
    assert "the old tree 1.030x" in details["edge_single_stream_vs_ortgenai"]
    assert details["cloud_16_streams_new_vs_old"] == "new 195.0 vs old 205.0 tok/s; 1 requests FAILED"


def test_a_value_is_judged_as_printed() -> None:
    report = _report()
    report["cloud"]["summary"]["64"]["new_vs_old"] = 0.9996  # prints 1.000x: passes
    row = targets(report)[-1]
    assert target_line(row) == "TARGET cloud_64_streams_new_vs_old: 1.000x (target >= 1.0x): PASS"


def test_without_llama_cpp_its_targets_are_skipped_with_the_reason() -> None:
    report = _report()
    why = "no llama.cpp build found: no llama-batched-bench on PATH (or pass --llama-cpp-bin DIR)"
    report["edge"]["llamacpp"] = {"skipped": why}
    for sample in report["edge"]["samples"]:
        sample["llamacpp"] = None
    report["edge"]["summary"] = edge_summary(report["edge"]["samples"], 16)
    rows = {row["name"]: row for row in targets(report)}
    assert target_line(rows["edge_16_streams_vs_llamacpp_new_vs_old"]) == (
        f"TARGET edge_16_streams_vs_llamacpp_new_vs_old: SKIPPED ({why})"
    )
    assert target_line(rows["edge_16_streams_vs_llamacpp"]) == f"TARGET edge_16_streams_vs_llamacpp: SKIPPED ({why})"
    assert "new n/a = 205.0 / n/a tok/s" in rows["edge_16_streams_vs_llamacpp_new_vs_old"]["detail"]
    assert rows["edge_single_stream_vs_ortgenai"]["pass"] is True
    report["targets"] = list(rows.values())
    assert f"llama.cpp: SKIPPED ({why})" in markdown(report)


def test_only_the_tiers_run_have_targets() -> None:
    report = _report()
    report["edge"] = None
    assert [row["name"] for row in targets(report)] == ["cloud_16_streams_new_vs_old", "cloud_64_streams_new_vs_old"]
    report = _report()
    report["cloud"] = None
    assert all(row["name"].startswith("edge_") for row in targets(report))


def test_a_busy_machine_is_flagged_before_the_targets() -> None:
    assert output_lines(_report())[0].startswith("TARGET edge_lone_stream_vs_ortgenai_new_vs_old:")
    busy = output_lines(_report(load_start=0.5, load_end=6.0))
    assert busy[0].startswith("WARNING: load average up to 6.0 on 2 CPUs")
    assert busy[2].startswith("  (lone-stream decode / onnxruntime-genai's: new 1.100x")


def test_markdown_names_the_trees_kernel_load_and_every_round() -> None:
    text = markdown(_report(load_start=0.25, load_end=0.75))
    assert "1-min load average 0.25 at the start, 0.75 at the end" in text
    assert "New: `/t` @ abc (services/ tree s1); old: `/t` @ abc (services/ tree s0)." in text
    assert "int4 kernel: new native, old native" in text
    assert "| new | 110.0 | 100.0 | 1.100x | 205.0 | 150.5 | 1.362x | 10.0 / 4.0 |" in text
    assert "- round 3 new: 108.0, 100.0; 205.0, n/a" in text
    assert f"new / old lone stream {110 / 102:.3f}x, 16 streams {205 / 190:.3f}x" in text
    assert "onnxruntime-genai 100.0 tok/s, llama.cpp 150.0 tok/s (medians)" in text
    assert "llama.cpp: `llama-batched-bench -m m`" in text
    assert "| 64 | 410.0 | 390.0 | 1.051x | 2.0 / 2.0 | 0 |" in text
    assert "| 16 | 195.0 | 205.0 | 0.951x | 2.0 / 2.0 | 1 |" in text
    assert "- round 2, 64 streams, old: 400.0 (100 tokens in 1.0 s)" in text
    assert "TARGET cloud_64_streams_new_vs_old: 1.051x (target >= 1.0x): PASS" in text
    assert "A/A" not in text


def test_the_workers_settings() -> None:
    assert edge_worker_settings("old", 2, "batched", 16) == {
        "MESHSERVE_EDGE_WORKER_WORKER_ID": "edge-old",
        "MESHSERVE_EDGE_WORKER_THREADS": "2",
        "MESHSERVE_EDGE_WORKER_ENGINE": "batched",
        "MESHSERVE_EDGE_WORKER_MAX_ACTIVE_SEQUENCES": "16",
        "MESHSERVE_EDGE_WORKER_MAX_QUEUE": "32",
    }
    assert cloud_worker_settings("new", 64) == {
        "MESHSERVE_GPU_WORKER_WORKER_ID": "cloud-new",
        "MESHSERVE_GPU_WORKER_DEVICE": "cpu",
        "MESHSERVE_GPU_WORKER_MAX_ACTIVE_SEQUENCES": "64",
    }


def test_the_log_sink_keeps_tails_and_kernel_fallbacks() -> None:
    logs = LogTail(keep=2)
    for i in range(3):
        logs("worker_old", f"line {i}")
    logs("worker_new", '{"event": "edge_int4_kernel_fallback", "reason": "no gcc"}')
    assert logs.dump().splitlines()[:2] == ["[worker_old] line 1", "[worker_old] line 2"]
    assert logs.kernel_fallbacks == ['worker_new: {"event": "edge_int4_kernel_fallback", "reason": "no gcc"}']


def _fake_tree(root: Path, resolve: str) -> Path:
    """A tree with just the modules the kernel probe imports; its ``int4_kernel`` returns ``resolve``
    (an expression over the settings)."""
    for package in ("services", "services/common", "services/edge_worker"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / "services/common/config.py").write_text(
        "import os\n\ndef load_settings(cls):\n    return cls(os.environ.get('MESHSERVE_EDGE_WORKER_THREADS'))\n"
    )
    (root / "services/edge_worker/config.py").write_text(
        "class EdgeWorkerSettings:\n    def __init__(self, threads):\n        self.threads = threads\n"
    )
    (root / "services/edge_worker/server.py").write_text(
        f"def int4_kernel(settings):\n    print('a log line')\n    return {resolve}\n"
    )
    return root


def test_the_kernel_is_resolved_by_that_trees_own_code(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path / "a", "'native' if settings.threads == '2' else 'mlas'")
    assert resolved_int4_kernel(tree, edge_worker_settings("old", 2, "batched", 16)) == "native"
    assert resolved_int4_kernel(tree, edge_worker_settings("old", 1, "batched", 16)) == "mlas"
    broken = _fake_tree(tmp_path / "b", "1 / 0")
    found = resolved_int4_kernel(broken, {})
    assert found.startswith("unknown (the probe failed: ") and "ZeroDivisionError" in found


def test_the_benchmark_is_a_bench_subcommand() -> None:
    assert bench_cli.SUBCOMMANDS["tiers-ab"][0] == "benchmarks.worker.tiers_ab"
