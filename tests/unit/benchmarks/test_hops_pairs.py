"""The hop benchmark's paired phase: each path alone against the base path, alternated request by request."""

from __future__ import annotations

import pytest

from benchmarks.gateway.hops_pairs import Sample, ab_paired, paired, summary


async def test_each_path_is_paired_with_the_base_alone_and_alternated() -> None:
    calls: list[str] = []

    def probe(name: str, ttft_s: float) -> object:
        async def call() -> Sample:
            calls.append(name)
            return ttft_s, ttft_s + 0.001, 4

        return call

    probes = {"direct": probe("direct", 0.002), "a": probe("a", 0.003), "b": probe("b", 0.0035)}
    out = await paired(probes, "direct", requests=50, warmup=2)  # type: ignore[arg-type]
    assert set(out) == {"a", "b"}
    assert out["a"]["added_ttft_p50_ms"] == pytest.approx(1.0)
    assert out["b"]["added_ttft_p50_ms"] == pytest.approx(1.5)
    assert out["a"]["base_ttft_p50_ms"] == pytest.approx(2.0)
    assert out["a"]["requests"] == 50
    # All of a's pairs come before b's, each pair is one direct and one path call, in either order.
    assert calls.count("direct") == 2 * (50 + 2)
    a_part, b_part = calls[: 2 * 52], calls[2 * 52 :]
    assert set(a_part) == {"direct", "a"} and set(b_part) == {"direct", "b"}
    pairs = [a_part[i : i + 2] for i in range(0, len(a_part), 2)]
    assert all(sorted(p) == ["a", "direct"] for p in pairs)
    assert {tuple(p) for p in pairs[2:]} == {("a", "direct"), ("direct", "a")}  # the order varies


def test_summary_subtracts_the_base_percentiles() -> None:
    base = [(0.001 * i, 0.002 * i, 3) for i in range(1, 101)]
    path = [(0.001 * i + 0.0005, 0.002 * i + 0.001, 3) for i in range(1, 101)]
    row = summary(path, base)
    assert row["added_ttft_p50_ms"] == pytest.approx(0.5)
    assert row["added_total_p50_ms"] == pytest.approx(1.0)
    assert row["relay_us_per_frame"] == pytest.approx(250.0)
    assert "added_ttft_p50_ms" not in summary(base, None)


async def test_ab_pairs_interleave_both_trees_each_against_its_own_direct_call() -> None:
    calls: list[str] = []

    def probe(name: str, ttft_s: float) -> object:
        async def call() -> Sample:
            calls.append(name)
            return ttft_s, ttft_s + 0.001, 4

        return call

    sides = {
        "a": {"direct_worker": probe("a:direct", 0.002), "gw": probe("a:gw", 0.003)},
        "b": {"direct_worker": probe("b:direct", 0.004), "gw": probe("b:gw", 0.0045)},
    }
    out = await ab_paired(sides, "direct_worker", requests=40, warmup=1)  # type: ignore[arg-type]
    assert out["a"]["gw"]["added_ttft_p50_ms"] == pytest.approx(1.0)
    assert out["b"]["gw"]["added_ttft_p50_ms"] == pytest.approx(0.5)  # over b's own direct call, not a's
    assert out["b"]["gw"]["pair_ttft_p50_ms"] == pytest.approx(0.5)
    assert out["a"]["gw"]["base_ttft_p50_ms"] == pytest.approx(2.0) and out["a"]["gw"]["requests"] == 40
    rounds = [calls[i : i + 4] for i in range(4, len(calls), 4)]  # after the warm-up round
    assert len(rounds) == 40
    # Every round: each side's pair together (its direct call and its path), both sides, in either order.
    assert all(sorted(r) == ["a:direct", "a:gw", "b:direct", "b:gw"] for r in rounds)
    assert all({r[0][0], r[1][0]} == {r[0][0]} and {r[2][0], r[3][0]} == {r[2][0]} for r in rounds)
    assert {r[0][0] for r in rounds} == {"a", "b"}  # which tree goes first varies
