"""docs/benchmarks/README.md from sample JSON files; load-run text, comparison and charts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import charts
from benchmarks import cli as bench_cli
from benchmarks.load import report as load_report
from benchmarks.report import NOT_MEASURED, generate


def _write(directory: Path, name: str, data: dict[str, Any]) -> None:
    (directory / name).write_text(json.dumps(data))


def _row(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {label} |"))


def test_report_reads_numbers_judges_them_and_names_the_command(tmp_path: Path) -> None:
    _write(tmp_path, "relay.json", {"date": "2026-01-02T03:04:05+00:00", "command": "meshserve bench relay --x 1",
                                    "gateway_router_tokens_per_s": 6123.4})  # fmt: skip
    rounds = [{"streams": 1, "aggregate_tokens_per_s": 100.0}, {"streams": 16, "aggregate_tokens_per_s": 350.0}]
    _write(tmp_path, "edge.json", {"date": "2026-01-01", "single_stream_roofline_share": 0.61, "rounds": rounds})
    text = generate(tmp_path)
    relay = _row(text, "tok/s, 32 streams paced one token per 5 ms (synthetic worker)")
    assert "6,123 tok/s" in relay and "| pass |" in relay and "2026-01-02 03:04" in relay
    assert "`meshserve bench relay --x 1`" in relay
    assert "| pass |" in _row(text, "single stream, share of memory-bandwidth roofline")
    scaling = _row(text, "aggregate tok/s at 16 streams / at 1 stream")
    assert "3.50x" in scaling and "**fail**" in scaling
    assert "`python -m benchmarks.edge.mesh`" in scaling  # the file named no command: the default one


def test_issue_27_edge_targets_are_read_from_the_judged_targets(tmp_path: Path) -> None:
    targets = {
        "edge_single_stream_vs_ortgenai": {"ratio": 0.93},
        "edge_16_streams_vs_llamacpp": {"skipped": "no build"},
    }
    _write(tmp_path, "edge.json", {"date": "2026-01-01", "targets": targets})
    text = generate(tmp_path)
    single = _row(text, "single stream through the mesh / onnxruntime-genai's single stream in-process, same run")
    assert "0.93x" in single and "**fail**" in single
    many = _row(text, "16 streams through the mesh / llama.cpp (Q4_0 of the same GGUF) at 16 streams, same run")
    assert f"{NOT_MEASURED} (no such number in edge.json)" in many  # skipped: never a number


def test_missing_files_and_numbers_are_shown_as_not_measured(tmp_path: Path) -> None:
    _write(tmp_path, "cloud.json", {"date": "2026-01-01", "throughput": {"16": {"ours": {"tokens_per_s": 5.0}}}})
    text = generate(tmp_path)
    assert f"| {NOT_MEASURED} |" in _row(text, "tok/s, 32 streams paced one token per 5 ms (synthetic worker)")
    missing_key = _row(text, "tok/s at 16 streams / transformers generate_batch")
    assert f"{NOT_MEASURED} (no such number in cloud.json)" in missing_key
    for title in ("Mesh overhead", "Cache-hit TTFT", "Edge tier", "Cloud tier", "Prefix reuse", "Speculative",
                  "Cancel latency", "Tokens relayed", "Gateway overhead vs LiteLLM", "Soak"):  # fmt: skip
        assert f"## {title}" in text


def test_soak_row_reports_the_largest_growth(tmp_path: Path) -> None:
    series = {"gateway/rss_mb": {"growth_pct": 1.5}, "router/fds": {"growth_pct": 7.25}}
    _write(tmp_path, "soak.json", {"date": "2026-01-01", "command": "c", "verdict": {"series": series}})
    row = _row(generate(tmp_path), "largest RSS / open-fd growth, baseline window → final window")
    assert "7.25 %" in row and "**fail**" in row


def test_bench_report_subcommand_writes_the_readme(tmp_path: Path) -> None:
    _write(tmp_path, "relay.json", {"gateway_router_tokens_per_s": 100.0})
    assert bench_cli.main(["report", "--dir", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "**fail**" in _row(text, "tok/s, 32 streams paced one token per 5 ms (synthetic worker)")
    assert "[relay.json](relay.json)" in text


def _run(name: str, values: dict[str, float], mode: str = "closed") -> dict[str, Any]:
    summary = {key: values.get(key, 1.0) for key, _label in load_report.COLUMNS}
    summary |= {"ok": 5, "requests": 5, "errors": {}, "routes": {"cache": 2, "edge/edge-0": 3}}
    return {
        "name": name,
        "date": "2026-01-01",
        "command": f"run {name}",
        "mode": mode,
        "machine": {"cpus": 2, "load_avg_1m": 1.0},
        "workload": {"short": 1, "long": 0, "chat": 0, "cache_hit_ratio": 0.2, "max_tokens": 8},
        "max_requests": 5,
        "duration_s": 10,
        "targets": {"mesh_grpc": [{"load": 1, "summary": summary}, {"load": 2, "summary": summary}]},
    }


def test_compare_prints_both_runs_and_the_change() -> None:
    text = load_report.compare(_run("a", {"tokens_per_s": 100.0}), _run("b", {"tokens_per_s": 200.0}))
    assert "| mesh_grpc | 1 | tok/s | 100.00 | 200.00 | +100.0 % |" in text
    assert "| mesh_grpc | 2 | TTFT p50 | 1.00 | 1.00 | +0.0 % |" in text
    other = _run("c", {})
    other["targets"] = {"naive_transformers": other["targets"]["mesh_grpc"]}
    assert "(no target and load in common)" in load_report.compare(_run("a", {}), other)


def test_compare_subcommand_reads_two_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, "a.json", _run("a", {"e2e_ms_p99": 10.0}))
    _write(tmp_path, "b.json", _run("b", {"e2e_ms_p99": 5.0}))
    assert bench_cli.main(["load", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "| mesh_grpc | 1 | e2e p99 | 10.00 | 5.00 | -50.0 % |" in capsys.readouterr().out


def test_markdown_and_charts_of_a_load_run(tmp_path: Path) -> None:
    report = _run("x", {"tokens_per_s": 42.0}, mode="open")
    text = load_report.markdown(report)
    assert "| mesh_grpc | 1 | 5/5 |" in text and "cache: 2, edge/edge-0: 3" in text and "offered req/s" in text
    for path in (
        charts.latency_chart(report, tmp_path / "e2e.png"),
        charts.latency_chart(report, tmp_path / "ttft.png", "ttft_ms"),
        charts.throughput_chart(report, tmp_path / "tput.png"),
    ):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_issue_37_and_41_targets_are_read_from_their_reports(tmp_path: Path) -> None:
    runtime = [{"name": "worker_runtime_64_streams_vs_old", "value": 10.89},
               {"name": "worker_runtime_256_streams_ms_per_step", "value": 3.5}]  # fmt: skip
    _write(tmp_path, "worker_runtime.json", {"date": "2026-12-02T06:50:53+00:00", "command": "rt", "targets": runtime})
    tiers = [{"name": "edge_16_streams_vs_llamacpp", "value": 0.91},
             {"name": "cloud_16_streams_new_vs_old", "value": None, "skipped": "no cloud run"}]  # fmt: skip
    _write(tmp_path, "tiers_ab.json", {"date": "2026-12-02", "command": "tiers", "targets": tiers})
    rates = [
        {"tier": "edge", "door": "grpc", "kind": "json_object", "answers": 40, "invalid": 0, "length": 2},
        {"tier": "edge", "door": "grpc", "kind": "tools", "answers": 10, "invalid": 1, "length": 3},
        {"tier": "edge", "door": "grpc", "kind": "stop", "answers": 50, "invalid": 0, "length": 30},
    ]
    _write(tmp_path, "structured_guarantees.json", {"date": "2026-12-02T06:46+00:00", "rates": rates})
    text = generate(tmp_path)
    row = _row(text, "64 streams, tok/s / the old runtime's, in-process")
    assert "10.89x" in row and "| pass |" in row and "`rt`" in row
    assert "**fail**" in _row(text, "256 streams, runtime ms per engine step, in-process")
    assert f"| {NOT_MEASURED} (no such number in worker_runtime.json) |" in _row(
        text, "lone stream, runtime overhead per step over 2 ms model steps"
    )
    assert "0.91x" in _row(text, "edge, 16 streams, the new tree / llama.cpp (issue 27's target, same run)")
    assert NOT_MEASURED in _row(text, "cloud worker on CPU, 16 streams, tok/s new / old")  # skipped: no number
    invalid = _row(text, "edge tier, invalid answers (JSON object, JSON schema, tools, stop strings; gRPC and HTTP)")
    assert "| 0 | 1 | **fail** |" in invalid and "`python -m benchmarks.structured.guarantees`" in invalid
    length = _row(text, "edge tier, JSON and tool answers finished at max_tokens")
    assert "10.00 %" in length and "| pass |" in length  # 5 of the 50 JSON and tool answers; stop strings aside
    assert NOT_MEASURED in _row(text, "cloud tier, JSON and tool answers finished at max_tokens")


def test_all_reports_lists_each_report_once_and_names_an_undescribed_file(tmp_path: Path) -> None:
    for name in ("edge.md", "edge.json", "stray_2026-01-01.md"):
        (tmp_path / name).write_text("{}")
    text = generate(tmp_path)
    section = text.split("## All reports", 1)[1]
    edge = [line for line in section.splitlines() if "[edge.md](edge.md)" in line]
    assert len(edge) == 1 and "[edge.json](edge.json)" in edge[0] and "`python -m benchmarks.edge`" in edge[0]
    assert "- [stray_2026-01-01.md](stray_2026-01-01.md): not described yet" in section
    assert "hops.md" not in section  # a report with no file here is not listed


def test_every_file_of_docs_benchmarks_is_one_described_report() -> None:
    """docs/benchmarks holds one current report per benchmark, each named by exactly one REPORTS entry."""
    from benchmarks.report import REPORTS

    bench_dir = Path(__file__).resolve().parents[3] / "docs" / "benchmarks"
    named = [name for report in REPORTS for name in report.files()]
    assert len(named) == len(set(named))
    missing = [name for name in named if not (bench_dir / name).exists()]
    assert missing == []
    undescribed = sorted(p.name for p in bench_dir.iterdir() if p.name != "README.md" and p.name not in named)
    assert undescribed == []
