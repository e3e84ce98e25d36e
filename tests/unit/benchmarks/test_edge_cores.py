"""benchmarks/edge/cores.py: the decode-call timer, its medians, and the targets judged per engine kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.edge.cores import DecodeTimer, judge, summarize_calls, summary_lines


@dataclass
class _Seq:
    kv_len: int


class _Engine:
    def __init__(self, min_rows: int) -> None:
        self.min_rows = min_rows
        self.seen: list[int] = []

    def _decode(self, seqs: list[_Seq]) -> str:
        self.seen.append(len(seqs))
        return f"logits for {len(seqs)}"


def test_timer_records_only_calls_of_its_row_count_once_switched_on() -> None:
    engine = _Engine(min_rows=2)
    timer = DecodeTimer(engine, rows=2)
    assert engine._decode([_Seq(7)]) == "logits for 1"  # off: passed through, not recorded
    timer.on = True
    engine._decode([_Seq(100)])  # a lone sequence runs as 2 rows (min_rows): recorded
    engine._decode([_Seq(101), _Seq(140)])
    engine._decode([_Seq(5), _Seq(6), _Seq(7)])  # 3 rows: another M, not recorded
    assert engine.seen == [1, 1, 2, 3]
    assert [past for _, _, past in timer.calls] == [100, 140]
    assert all(cpu >= 0 and wall >= 0 for cpu, wall, _ in timer.calls)


def test_call_summary_is_medians_and_the_past_range() -> None:
    summary = summarize_calls([(10.0, 11.0, 100), (30.0, 31.0, 104), (20.0, 50.0, 102)])
    assert summary == {"calls": 3, "cpu_ms": 20.0, "wall_ms": 31.0, "past_min": 100, "past_max": 104}


def _row(streams: int, aggregate: float, cpu_ms: float, decode: float) -> dict[str, Any]:
    return {
        "streams": streams,
        "aggregate_tokens_per_s": aggregate,
        "cpu_ms_per_token": cpu_ms,
        "decode_tokens_per_s_per_stream": decode,
    }


def _rows(single: float, top: float, decode: float) -> list[dict[str, Any]]:
    return [_row(1, single, 20.0, decode), _row(4, 2 * single, 10.0, 1.0), _row(16, top, 5.0, 1.0)]


def test_each_kind_is_judged_against_both_targets() -> None:
    direct = {"batched": _rows(50.0, 210.0, 45.0), "batched-1row": _rows(60.0, 180.0, 55.0)}
    judged = judge(direct, roofline=100.0)
    met = {kind: (j["roofline_target_met"], j["scaling_target_met"]) for kind, j in judged.items()}
    assert met == {"batched": (False, True), "batched-1row": (True, False)}
    assert judged["batched"]["cpu_ratio_top_vs_1"] == 4.0
    report = {"cpus": [0, 1], "threads": 2, "read_bandwidth_gbs": 12.0, "roofline_tokens_per_s": 100.0,
              "direct": direct, "judged": judged}  # fmt: skip
    lines = summary_lines(report)
    assert lines[0] == "cpus [0, 1], 2 threads: bandwidth 12.0 GB/s, roofline 100 tok/s"
    assert "(4.20x;" in lines[1] and "= 45 % of the roofline; targets: roofline FAIL, scaling PASS" in lines[1]
    assert "(3.00x;" in lines[2] and "= 55 % of the roofline; targets: roofline PASS, scaling FAIL" in lines[2]
