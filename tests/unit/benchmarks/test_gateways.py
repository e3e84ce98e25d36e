"""``meshserve bench gateways``' report judges each front door's added time as a share of LiteLLM's."""

from __future__ import annotations

from typing import Any

from benchmarks.gateway.vs_litellm import markdown, target_lines, targets


def _path(e2e_p50: float) -> dict[str, float]:
    return {"ok": 10, "requests": 10, "ttft_ms_p50": e2e_p50 / 2, "e2e_ms_p50": e2e_p50, "e2e_ms_p95": e2e_p50 + 1}


def _report(added: dict[str, float]) -> dict[str, Any]:
    paths = {"fake_backend": 2.0, "instant_worker": 3.0, **{n: 3.0 + a for n, a in added.items()}}
    return {
        "date": "2026-11-27T00:00:00+00:00",
        "machine": {"cpus": 2, "load_avg_1m": 1.0},
        "command": "meshserve bench gateways",
        "layout": "embedded",
        "concurrency": 1,
        "max_tokens": 16,
        "published_litellm": "p50 2 ms",
        "paths": {name: _path(v) | {"e2e_ms_p99": v + 2} for name, v in paths.items()},
        "added_ms": {
            name: {"p50": a, "p99": a, "ttft_p50": a, "over": "instant_worker" if name != "litellm" else "fake_backend"}
            for name, a in added.items()
        },
        "notes": [],
    }


def test_target_lines_give_the_same_run_ratio_to_litellm_with_pass_or_fail() -> None:
    report = _report({"litellm": 25.0, "meshserve_grpc": 2.0, "meshserve_http": 6.0})
    report["targets"] = targets(report["added_ms"])
    text = markdown(report)
    assert "TARGET gateways_grpc_vs_litellm: 0.080 (target <= 0.1): PASS" in text.splitlines()
    assert "TARGET gateways_http_vs_litellm: 0.240 (target <= 0.2): FAIL" in text.splitlines()
    assert "the router embedded in the gateway's process" in text
    report |= {"litellm_version": "1.2.3", "front_door_cpu_ms_per_request": {"litellm": 20.0, "meshserve_grpc": 1.0}}
    text = markdown(report)
    assert "LiteLLM 1.2.3." in text
    assert "`meshserve_grpc` 1.00 ms (gateway + router + redis, 0.050x LiteLLM's)" in text


def test_without_litellm_the_targets_fail_and_say_why() -> None:
    report = _report({"meshserve_grpc": 2.0, "meshserve_http": 6.0})
    assert target_lines(report) == [
        "TARGET gateways_grpc_vs_litellm: n/a (LiteLLM not measured) (target <= 0.1): FAIL",
        "TARGET gateways_http_vs_litellm: n/a (LiteLLM not measured) (target <= 0.2): FAIL",
    ]
