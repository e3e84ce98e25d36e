"""The edge benchmark's summary: medians of interleaved rounds and the two targets, judged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import cli as bench_cli
from benchmarks.edge import llamacpp, mesh
from benchmarks.edge.mesh import (
    NO_SINGLE_STREAM,
    _median_round,
    judged,
    llamacpp_runner,
    markdown,
    parse_stream_counts,
    single_stream_measures,
    targets,
)


def _report(load: float, single: float, top: float, share: float) -> dict[str, Any]:
    rounds = [
        {"streams": 1, "aggregate_tokens_per_s": single, "worker_cpu_ms_per_token": 20.0, "peak_rss_bytes": 1,
         "ttft_ms_p50": 1.0, "itl_ms_p50": 1.0, "decode_tokens_per_s": single, "repeats": 2},
        {"streams": 16, "aggregate_tokens_per_s": top, "worker_cpu_ms_per_token": 5.0, "peak_rss_bytes": 2,
         "ttft_ms_p50": 1.0, "itl_ms_p50": 1.0, "decode_tokens_per_s": 1.0, "repeats": 2},
    ]  # fmt: skip
    return {
        "date": "2026-01-01", "machine": {"cpus": 2, "load_avg_1m": load}, "command": "x", "engine": "batched",
        "weight_bytes_per_token": 1 << 20, "weight_bytes_total": 1 << 21, "read_bandwidth_gbs": 20.0,
        "roofline_tokens_per_s": 100.0, "single_stream_decode_tokens_per_s": share * 100,
        "single_stream_roofline_share": share, "idle_rss_bytes": 1, "memory_per_stream_bytes": 1.0,
        "rounds": rounds, "scaling_top_vs_single": top / single, "cpu_scaling_top_vs_single": 4.0,
    }  # fmt: skip


def test_median_round_takes_medians_and_the_peak_memory() -> None:
    rounds = [
        {"streams": 4, "aggregate_tokens_per_s": 10.0, "peak_rss_bytes": 5, "worker_cpu_ms_per_token": 3.0},
        {"streams": 4, "aggregate_tokens_per_s": 30.0, "peak_rss_bytes": 9, "worker_cpu_ms_per_token": 1.0},
        {"streams": 4, "aggregate_tokens_per_s": 20.0, "peak_rss_bytes": 7, "worker_cpu_ms_per_token": 2.0},
    ]
    merged = _median_round(rounds)
    assert merged == {
        "streams": 4, "repeats": 3, "aggregate_tokens_per_s": 20.0, "peak_rss_bytes": 9, "worker_cpu_ms_per_token": 2.0
    }  # fmt: skip


def test_targets_are_judged_and_a_busy_machine_is_flagged() -> None:
    report = _report(load=0.3, single=50.0, top=210.0, share=0.52)
    report["ortgenai_decode_tokens_per_s"] = 50.0
    report["llamacpp"] = {"rounds": [{"streams": 1, "aggregate_tokens_per_s": 100.0},
                                     {"streams": 16, "aggregate_tokens_per_s": 160.0}]}  # fmt: skip
    quiet = targets(report)
    assert quiet[0] == "TARGET edge_single_stream_vs_ortgenai: 1.04x (target >= 1.0x): PASS"
    assert "through the mesh 52.0 tok/s vs onnxruntime-genai in-process 50.0 tok/s" in quiet[1]
    assert quiet[2] == "TARGET edge_16_streams_vs_llamacpp: 1.31x (target >= 1.25x): PASS"
    assert "210.0 tok/s vs llama.cpp Q4_0 160.0 tok/s" in quiet[3]
    assert "roofline 52 %" in quiet[4] and "16 streams / 1 stream 4.20x" in quiet[4] and "4.00x" in quiet[4]
    busy = _report(load=9.0, single=50.0, top=150.0, share=0.45)
    busy["ortgenai_decode_tokens_per_s"] = 60.0
    busy["llamacpp"] = {"skipped": "no llama.cpp build found: no llama-batched-bench on PATH"}
    lines = targets(busy)
    assert lines[0].startswith("WARNING: load average 9.0 on 2 CPUs")
    assert lines[1] == "TARGET edge_single_stream_vs_ortgenai: 0.75x (target >= 1.0x): FAIL"
    assert lines[3] == (
        "TARGET edge_16_streams_vs_llamacpp: SKIPPED (no llama.cpp build found: no llama-batched-bench on PATH)"
    )
    assert "- TARGET edge_single_stream_vs_ortgenai: 0.75x" in markdown(busy)
    unmeasured = targets(_report(load=0.3, single=50.0, top=150.0, share=0.45))
    assert unmeasured[0].startswith("TARGET edge_single_stream_vs_ortgenai: SKIPPED (")
    assert unmeasured[1] == "TARGET edge_16_streams_vs_llamacpp: SKIPPED (llama.cpp not measured)"


def test_judged_targets_are_stored_for_the_report() -> None:
    report = _report(load=0.3, single=50.0, top=210.0, share=0.52)
    report["ortgenai_decode_tokens_per_s"] = 100.0
    found = judged(report)
    assert found["edge_single_stream_vs_ortgenai"]["ratio"] == pytest.approx(0.52)
    assert found["edge_single_stream_vs_ortgenai"]["pass"] is False
    assert found["edge_16_streams_vs_llamacpp"] == {"skipped": "llama.cpp not measured"}


def test_llamacpp_tools_are_looked_for_and_their_table_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert llamacpp.find_tools(None) == (
        "no llama.cpp build found: no llama-batched-bench on PATH (or pass --llama-cpp-bin DIR)"
    )
    assert "in " + str(tmp_path) in str(llamacpp.find_tools(tmp_path))
    for name in ("llama-batched-bench", "llama-quantize"):
        (tmp_path / name).write_text("")
    assert llamacpp.find_tools(tmp_path) == (tmp_path / "llama-batched-bench", tmp_path / "llama-quantize")
    table = """
main: n_kv_max = 1088, n_batch = 2048
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |     48 |    1 |     64 |    0.030 |   533.33 |    0.320 |   150.00 |    0.350 |   182.86 |
|    16 |     48 |   16 |   1024 |    0.500 |   512.00 |    2.500 |   307.20 |    3.000 |   341.33 |
"""
    rows = llamacpp.parse_table(table)
    assert [(r["B"], r["S_TG t/s"]) for r in rows] == [(1.0, 150.0), (16.0, 307.2)]


def test_llamacpp_runs_interleaved_with_the_mesh_rounds_are_summarized_by_medians() -> None:
    def run(one: float, sixteen: float) -> dict[str, Any]:
        return {"model": "m.gguf", "command": "llama-batched-bench ...", "rounds": [
            {"streams": 1, "aggregate_tokens_per_s": one, "decode_tokens_per_s": one},
            {"streams": 16, "aggregate_tokens_per_s": sixteen, "decode_tokens_per_s": sixteen / 16},
        ]}  # fmt: skip

    samples = [run(150.0, 260.0), run(140.0, 200.0), run(160.0, 240.0)]
    summary = llamacpp.summary(samples)
    assert summary["rounds"] == [
        {"streams": 1, "repeats": 3, "aggregate_tokens_per_s": 150.0, "decode_tokens_per_s": 150.0},
        {"streams": 16, "repeats": 3, "aggregate_tokens_per_s": 240.0, "decode_tokens_per_s": 15.0},
    ]
    assert summary["samples"] == samples and summary["model"] == "m.gguf"
    report = _report(load=0.3, single=50.0, top=300.0, share=0.52)
    report["llamacpp"] = summary
    report["round_samples"] = [{"streams": 16, "aggregate_tokens_per_s": v} for v in (310.0, 290.0, 300.0)]
    assert judged(report)["edge_16_streams_vs_llamacpp"]["ratio"] == pytest.approx(1.25)
    assert "- 16 streams, aggregate tok/s: the mesh 310.0, 290.0, 300.0; llama.cpp 260.0, 200.0, 240.0" in (
        markdown(report)
    )


def test_without_a_llamacpp_build_the_runner_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    args = argparse.Namespace(llama_cpp_bin=None, llama_cpp_dir=tmp_path, threads=2, max_tokens=8)
    assert llamacpp_runner(args, [1, 16]) == (
        "no llama.cpp build found: no llama-batched-bench on PATH (or pass --llama-cpp-bin DIR)"
    )


def test_meshserve_bench_edge_is_wired() -> None:
    assert bench_cli.SUBCOMMANDS["edge"][0] == "benchmarks.edge.mesh"


def test_unknown_in_process_engine_variants_are_refused_before_loading(tmp_path: Path) -> None:
    from benchmarks.edge.direct import load_engine

    for kind in ("batched-fast", "vllm", "batched-nbitshead-8bit"):
        with pytest.raises(ValueError, match="unknown engine kind"):
            load_engine(kind, tmp_path, threads=1, max_batch=2)


def _round(streams: int, tokens_per_s: float) -> dict[str, Any]:
    return {"streams": streams, "aggregate_tokens_per_s": tokens_per_s, "worker_cpu_ms_per_token": 5.0,
            "peak_rss_bytes": 2, "ttft_ms_p50": 1.0, "itl_ms_p50": 1.0, "decode_tokens_per_s": tokens_per_s / streams,
            "repeats": 1}  # fmt: skip


def _report_without_a_lone_stream(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    report = _report(load=0.3, single=1.0, top=1.0, share=0.5) | {"rounds": rounds}
    report |= single_stream_measures(rounds, roofline=100.0)
    report["llamacpp"] = {"rounds": [{"streams": 1, "aggregate_tokens_per_s": 100.0},
                                     {"streams": 16, "aggregate_tokens_per_s": 160.0}]}  # fmt: skip
    return report


def test_stream_counts_are_sorted_and_a_bad_set_is_refused_in_one_sentence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_stream_counts("16") == [16]
    assert parse_stream_counts("16,1,4,4") == [1, 4, 16]  # the last is the largest: llama.cpp's count
    for bad in ("0,4", "four", ""):
        with pytest.raises(ValueError, match="--streams"):
            parse_stream_counts(bad)
    with pytest.raises(SystemExit) as exit_info:
        mesh.main(["--streams", "0,16"])
    assert exit_info.value.code == 2
    assert "every count at least 1, such as 1,4,16; got '0,16'" in capsys.readouterr().err


def test_without_a_lone_stream_the_rest_is_reported_and_the_single_stream_measures_say_why() -> None:
    rounds = [_round(4, 120.0), _round(16, 210.0)]
    assert single_stream_measures(rounds, roofline=100.0) == {
        "single_stream_decode_tokens_per_s": None, "single_stream_roofline_share": None,
        "scaling_top_vs_single": None, "cpu_scaling_top_vs_single": None,
    }  # fmt: skip
    report = _report_without_a_lone_stream(rounds)
    report["ortgenai_decode_tokens_per_s"] = None
    found = judged(report)
    assert found["edge_single_stream_vs_ortgenai"] == {"skipped": NO_SINGLE_STREAM}
    assert found["edge_16_streams_vs_llamacpp"]["ratio"] == pytest.approx(210.0 / 160.0)
    lines = targets(report)
    assert lines[0] == f"TARGET edge_single_stream_vs_ortgenai: SKIPPED ({NO_SINGLE_STREAM})"
    assert lines[1] == "TARGET edge_16_streams_vs_llamacpp: 1.31x (target >= 1.25x): PASS"
    assert "no single-stream round: --streams has no 1, so no roofline share and no 16-vs-1 ratios" in lines[-1]
    text = markdown(report)
    assert f"- single-stream decode: not measured ({NO_SINGLE_STREAM})" in text
    assert "| streams | aggregate tok/s | x 4 streams |" in text and "| 16 | 210.0 | 1.75 |" in text


def test_a_run_at_16_streams_only_writes_its_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m benchmarks.edge --streams 16`` (issue 42: it ended in a StopIteration traceback)."""
    seen: dict[str, Any] = {}

    async def fake_run(max_tokens: int, threads: int, counts: list[int], *args: Any, **kwargs: Any) -> dict[str, Any]:
        seen["counts"] = counts
        return _report_without_a_lone_stream([_round(n, 200.0) for n in counts])

    monkeypatch.setattr(mesh, "run", fake_run)
    monkeypatch.setattr(mesh, "llamacpp_runner", lambda args, counts: "no llama.cpp build found")
    assert mesh.main(["--streams", "16", "--no-direct", "--out", str(tmp_path)]) == 0
    assert seen["counts"] == [16]
    text = (tmp_path / "edge.md").read_text()
    assert f"TARGET edge_single_stream_vs_ortgenai: SKIPPED ({NO_SINGLE_STREAM})" in text
    assert "| 16 | 200.0 | 1.00 |" in text
