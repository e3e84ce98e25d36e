"""The edge structured-output benchmark's report: the TARGET line and its verdict."""

from __future__ import annotations

from benchmarks.edge.structured import markdown, target


def report(plain: float, constrained: float) -> dict[str, object]:
    def variant(cpu: float) -> dict[str, object]:
        return {
            "cpu_ms_per_token": cpu,
            "aggregate_tokens_per_s": 10.0,
            "rounds_cpu_ms_per_token": [cpu],
            "rounds_tokens_per_s": [10.0],
        }

    return {
        "streams": 16,
        "max_tokens": 32,
        "repeats": 1,
        "threads": 2,
        "first_compile_ms": 5.0,
        "load_avg_1m": 1.0,
        "cpus": 2,
        "plain": variant(plain),
        "json_schema": variant(constrained),
        "overhead": constrained / plain - 1,
    }


def test_the_target_line_passes_up_to_fifteen_percent_more_cpu() -> None:
    assert target(report(10.0, 11.0)).endswith("+10.0 % (target <= +15 %): PASS")
    assert target(report(10.0, 12.0)).endswith("+20.0 % (target <= +15 %): FAIL")
    text = markdown(report(10.0, 11.0), "meshserve bench edge-structured")
    assert "| json_schema | 11.00 |" in text and text.rstrip().splitlines()[-1].startswith("TARGET")
