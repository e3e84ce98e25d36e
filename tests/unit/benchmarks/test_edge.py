"""The edge benchmark's summary: medians of interleaved rounds and the two targets, judged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import cli as bench_cli
from benchmarks.edge.mesh import _median_round, markdown, targets


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
    quiet = targets(_report(load=0.3, single=50.0, top=210.0, share=0.52))
    assert quiet[0].endswith("52 % (target >= 50 %): PASS")
    assert quiet[1].endswith("4.20x (target >= 4x): PASS")
    assert "4.00x" in quiet[2]
    busy = targets(_report(load=9.0, single=50.0, top=150.0, share=0.45))
    assert busy[0].startswith("WARNING: load average 9.0 on 2 CPUs")
    assert busy[1].endswith("45 % (target >= 50 %): FAIL") and busy[2].endswith("3.00x (target >= 4x): FAIL")
    assert "- TARGET aggregate tok/s at 16 streams / 1 stream: 3.00x" in markdown(_report(9.0, 50.0, 150.0, 0.45))


def test_meshserve_bench_edge_is_wired() -> None:
    assert bench_cli.SUBCOMMANDS["edge"][0] == "benchmarks.edge.mesh"


def test_unknown_in_process_engine_variants_are_refused_before_loading(tmp_path: Path) -> None:
    from benchmarks.edge.direct import load_engine

    for kind in ("batched-fast", "vllm", "batched-nbitshead-8bit"):
        with pytest.raises(ValueError, match="unknown engine kind"):
            load_engine(kind, tmp_path, threads=1, max_batch=2)
