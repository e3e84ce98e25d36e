"""`meshserve status` pieces without a mesh: rendering a frame, reading metrics, finding the mesh."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from rich.console import Console

from services.cli.status import (
    MeshView,
    ReplicaView,
    _add_metrics,
    _parser,
    _rates_since,
    _targets,
    add_stopped,
    as_json,
    render,
)
from services.local.state import write_state


def frame(view: MeshView) -> str:
    out = io.StringIO()
    Console(file=out, width=140).print(render(view))
    return out.getvalue()


def test_frame_groups_replicas_by_tier_with_health_load_and_tokens() -> None:
    view = MeshView(router="127.0.0.1:7000", router_serving=True)
    view.replicas = [
        ReplicaView(
            "edge", "edge-0", "127.0.0.1:7001", True, 1, 0, 4, 1, 0, False, 12.5, 340, None, "awake", 300 * 2**20
        ),
        ReplicaView("edge", "edge-1", "127.0.0.1:7002", False, 0, 0, 4, 0, 2, True),
        ReplicaView("cloud", "cloud-0", "127.0.0.1:7003", True, 0, 2, 8, 0, 0, False, 3.0, 96),
    ]
    view.cache = {"response": (0.25, 3, 9, 4)}
    view.requests = {"OK": 12, "RESOURCE_EXHAUSTED": 2}
    view.counters = {"rate limited": 2}
    view.problems = ["cache 127.0.0.1:1: UNAVAILABLE (connection refused)"]
    text = frame(view)
    assert "router 127.0.0.1:7000 SERVING" in text
    assert "edge: 1/2 replicas healthy, 12.5 tokens/s" in text and "cloud: 1/1 replicas healthy, 3.0 tokens/s" in text
    cells = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in text.splitlines()
        if line.startswith("│")
    }
    assert cells["edge-0"] == ["127.0.0.1:7001", "up", "1/4", "0", "1", "12.5", "340", "0", "awake", "300 MiB"]
    assert cells["edge-1 (registered)"] == ["127.0.0.1:7002", "down", "0/4", "0", "0", "-", "-", "2", "-", "-"]
    assert cells["response"] == ["25.0%", "3", "9", "4"]
    assert "traffic: requests 14 · errors 2 · rate limited 2 · RESOURCE_EXHAUSTED 2" in text
    assert "unreachable: cache 127.0.0.1:1: UNAVAILABLE" in text


def test_frame_of_a_router_that_does_not_answer_says_so() -> None:
    text = frame(MeshView(router="127.0.0.1:1", problems=["router 127.0.0.1:1: UNAVAILABLE (refused)"]))
    assert "NOT SERVING" in text and "edge: no replicas" in text and "unreachable: router" in text


def test_traffic_counters_are_read_from_prometheus_text() -> None:
    registry = CollectorRegistry()
    duration = Histogram("meshserve_request_duration_seconds", "d", ["service", "tier", "status"], registry=registry)
    rejected = Counter("meshserve_rate_limit_rejections_total", "r", ["service", "tenant", "reason"], registry=registry)
    for status in ("OK", "OK", "RESOURCE_EXHAUSTED"):
        duration.labels("gateway", "edge", status).observe(0.1)
    duration.labels("router", "edge", "OK").observe(0.1)  # not the gateway: not counted twice
    rejected.labels("gateway", "a", "requests").inc(2)
    rejected.labels("gateway", "b", "tokens").inc()
    view = MeshView(router="r")
    _add_metrics("gateway", generate_latest(registry).decode(), view)
    assert view.requests == {"OK": 2, "RESOURCE_EXHAUSTED": 1}
    assert view.counters == {"rate limited": 3}


def test_addresses_come_from_up_state_file_unless_given(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_STATE_FILE", str(tmp_path / "mesh.json"))
    with pytest.raises(SystemExit, match="no router address; pass --router"):
        _targets(_parser().parse_args([]))
    write_state({"router": "127.0.0.1:7000", "cache": "127.0.0.1:7100", "metrics": {"gateway": "http://x/metrics"}})
    assert _targets(_parser().parse_args([])) == ("127.0.0.1:7000", "127.0.0.1:7100", {"gateway": "http://x/metrics"})
    args: argparse.Namespace = _parser().parse_args(["--router", "h:1", "--cache", "", "--metrics", "r=http://y"])
    assert _targets(args) == ("h:1", "", {"r": "http://y"})


def _at(total: int, at: float, rate: float = 9.0) -> ReplicaView:
    replica = ReplicaView("edge", "edge-0", "127.0.0.1:7001", True, 1, 0, 4, 1, 0, False, rate, total)
    replica.stats_at = at
    return replica


def test_tokens_per_s_is_the_count_change_since_the_last_frame() -> None:
    before, now = MeshView(router="r"), MeshView(router="r")
    before.replicas, now.replicas = [_at(100, 10.0)], [_at(130, 12.0)]
    _rates_since(now, before)
    assert now.replicas[0].tokens_per_s == 15.0
    restarted = MeshView(router="r")
    restarted.replicas = [_at(4, 13.0, rate=2.0)]  # a new process counts from 0: keep its own rate
    _rates_since(restarted, now)
    assert restarted.replicas[0].tokens_per_s == 2.0
    first = MeshView(router="r")
    first.replicas = [_at(7, 1.0)]
    _rates_since(first, None)
    assert first.replicas[0].tokens_per_s == 9.0


def test_frame_shows_the_supervised_services_restarts_and_crash_loops() -> None:
    view = MeshView(router="127.0.0.1:7000", router_serving=True)
    view.services = {
        "gateway": {"state": "running", "restarts": 0, "last_exit": "", "last_exit_at": ""},
        "edge-0": {
            "state": "running",
            "restarts": 2,
            "last_exit": "killed by SIGKILL",
            "last_exit_at": "2026-11-27T03:40:20+00:00",
        },
        "cache": {
            "state": "crash loop",
            "restarts": 7,
            "last_exit": "exit code 1",
            "last_exit_at": "2026-11-27T03:41:02",
        },
    }
    text = frame(view)
    assert "services: 3 supervised, 2 restarted" in text
    cells = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in text.splitlines()
        if line.startswith("│")
    }
    assert cells["gateway"] == ["running", "0", "-", "-"]
    assert cells["edge-0"] == ["running", "2", "killed by SIGKILL", "03:40:20"]
    assert cells["cache"] == ["crash loop", "7", "exit code 1", "03:41:02"]


def test_the_redis_line_names_each_role_and_hides_passwords() -> None:
    from services.cli.status import redis_roles

    two = {"redis": "redis://127.0.0.1:6001/0", "state_redis": "redis://:s3cret@127.0.0.1:6002/0", "state_dir": "/d"}
    assert redis_roles(two) == {
        "cache": "redis://127.0.0.1:6001/0",
        "state": "redis://***@127.0.0.1:6002/0 (append-only file in /d)",
    }
    one = {"redis": "redis://u:pw@h:6379/0", "state_redis": "redis://u:pw@h:6379/0"}
    assert redis_roles(one) == {"cache+state": "redis://***@h:6379/0"}
    assert redis_roles({"redis": "redis://h:6379/0"}) == {"cache+state": "redis://h:6379/0"}  # an older state file
    assert redis_roles({}) == {}
    view = MeshView(router="r:1", redis=redis_roles(two))
    out = io.StringIO()
    Console(file=out, width=200).print(render(view))
    assert "redis: cache redis://127.0.0.1:6001/0 · state redis://***@127.0.0.1:6002/0" in out.getvalue()


def test_each_replica_shows_its_model_state_and_memory_and_a_stopped_worker_is_listed() -> None:
    view = MeshView(router="127.0.0.1:7000", router_serving=True)
    view.replicas = [
        ReplicaView("edge", "edge-0", "127.0.0.1:7001", True, 0, 0, 4, 0, 0, True, 0.0, 0, 1.0, "asleep", 60 * 2**20),
        ReplicaView("edge", "edge-1", "127.0.0.1:7002", True, 0, 0, 4, 0, 0, True, 0.0, 0, 1.0, "waking", 90 * 2**20),
        ReplicaView("cloud", "cloud-0", "127.0.0.1:7003", True, 0, 0, 8, 0, 0, True, model_state="falling asleep"),
    ]
    view.services = {
        "gateway": {"state": "running", "restarts": 0},
        "edge-0": {"state": "running", "restarts": 0},
        "edge-2": {"state": "stopped (idle)", "restarts": 0, "stopped_at": "2026-12-02T14:00:00+00:00"},
        "cloud-1": {"state": "stopped (idle)", "restarts": 0},
        "edge-1": {"state": "stopped (idle)", "restarts": 0},  # listed by the router already (starting)
    }
    add_stopped(view)
    text = frame(view)
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    cells = {row[0]: row[1:] for row in rows if len(row) == 11}  # the replica tables' rows
    services = {row[0]: row[1:] for row in rows if len(row) == 5}
    assert cells["edge-0 (registered)"][-2:] == ["asleep", "60 MiB"]
    assert cells["edge-1 (registered)"][-2:] == ["waking", "90 MiB"]
    assert cells["cloud-0 (registered)"][-2:] == ["falling asleep", "-"]
    assert cells["edge-2"] == ["-", "stopped", "0/0", "0", "0", "-", "-", "0", "stopped", "0 MiB"]
    assert cells["cloud-1"][1] == "stopped" and cells["cloud-1"][-2] == "stopped"
    assert services["edge-2"][0] == "stopped (idle)" and services["gateway"][0] == "running"
    data = as_json(view)
    states = {r["name"]: (r["model_state"], r["resident_bytes"]) for r in data["replicas"]}  # type: ignore[attr-defined]
    assert states == {
        "edge-0": ("asleep", 60 * 2**20),
        "edge-1": ("waking", 90 * 2**20),
        "cloud-0": ("falling asleep", None),
        "edge-2": ("stopped", 0),
        "cloud-1": ("stopped", 0),
    }
    assert data["services"]["edge-2"]["state"] == "stopped (idle)"  # type: ignore[index]
    json.dumps(data)  # JSON-ready as it is
