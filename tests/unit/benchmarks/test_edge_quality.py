"""`meshserve bench edge-quality`: registered, and its target judged from the two engine graphs' perplexity."""

from __future__ import annotations

from benchmarks import cli as bench_cli
from benchmarks.edge.quality import TARGET_RATIO, judged
from services.models.evaluate import EvalResult


def result(name: str, perplexity: float) -> EvalResult:
    return EvalResult(name=name, perplexity=perplexity, top1_agreement=0.8, greedy32_agreement=0.2, tokens=100)


def test_edge_quality_is_a_bench_subcommand() -> None:
    assert bench_cli.SUBCOMMANDS["edge-quality"][0] == "benchmarks.edge.quality"


def test_native_within_half_a_percent_of_mlas_passes() -> None:
    base = [result("fp32", 42.0), result("int4 engine (mlas)", 45.5)]
    assert judged([*base, result("int4 engine (native)", 45.5 * TARGET_RATIO)])["pass"]
    verdict = judged([*base, result("int4 engine (native)", 45.5 * 1.01)])
    assert not verdict["pass"] and abs(verdict["ratio"] - 1.01) < 1e-9
    assert "skipped" in judged(base)  # no native row: the kernel cannot run here
