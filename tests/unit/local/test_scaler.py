"""The local scaler's policy (services/local/scaler.py) over fakes: routers' metrics text in, starts and
stops out. Stops only a model with a stop policy (min_replicas 0 and stop_after_s) once it has been idle
that long; starts one worker when a request is held and none runs, then the rest of what it stopped while the model
is in use; never two starts at once; a failed
start is retried only after its backoff."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.local.scaler import (
    Backoff,
    ModelSignal,
    Scaler,
    StopPolicy,
    WorkerMap,
    read_signals,
    sink_logger,
    stop_policies,
)

MODEL = "smollm2-135m-instruct"


def metrics(held: dict[tuple[str, str], float], idle: dict[tuple[str, str], float]) -> str:
    """A router's /metrics text with the two gauges, as prometheus_client writes it."""
    lines = ["# HELP meshserve_router_held_requests held", "# TYPE meshserve_router_held_requests gauge"]
    lines += [f'meshserve_router_held_requests{{model="{m}",version="{v}"}} {n}' for (m, v), n in held.items()]
    lines += ["# HELP meshserve_router_idle_seconds idle", "# TYPE meshserve_router_idle_seconds gauge"]
    lines += [f'meshserve_router_idle_seconds{{model="{m}",version="{v}"}} {s}' for (m, v), s in idle.items()]
    lines += ["# TYPE meshserve_router_requests_total counter", 'meshserve_router_requests_total{tier="edge"} 3']
    return "\n".join(lines) + "\n"


class FakeWorkers:
    """Worker processes by name: running or stopped; ``start`` can be made to fail or to wait."""

    def __init__(self, *running: str) -> None:
        self.running = set(running)
        self.stopped: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.fail_starts = 0
        self.gate: asyncio.Event | None = None

    def is_running(self, name: str) -> bool:
        return name in self.running

    def is_stopped(self, name: str) -> bool:
        return name in self.stopped

    async def stop(self, name: str) -> bool:
        self.calls.append(("stop", name))
        if name not in self.running:
            return False
        self.running.discard(name)
        self.stopped.add(name)
        return True

    async def start(self, name: str) -> None:
        self.calls.append(("start", name))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError(f"{name} exited with code 1 before serving")
        self.stopped.discard(name)
        self.running.add(name)


class Log:
    def __init__(self) -> None:
        self.lines: list[dict[str, object]] = []

    def __call__(self, name: str, line: str) -> None:
        assert name == "scaler"
        self.lines.append(json.loads(line))

    def events(self) -> list[str]:
        return [str(line["event"]) for line in self.lines]


async def settle() -> None:
    """Let the scaler's start/stop tasks run to their end (or to the fake's gate)."""
    for _ in range(5):
        await asyncio.sleep(0)


def scaler(workers: FakeWorkers, log: Log, **kw: object) -> Scaler:
    policy = StopPolicy(MODEL, stop_after_s=30.0, workers=("edge-0", "edge-1", "cloud-0"))
    return Scaler([policy], workers, log=sink_logger(log), **kw)  # type: ignore[arg-type]


def test_signals_sum_held_and_take_the_least_idle_over_versions_and_routers() -> None:
    one = metrics({(MODEL, "prepared"): 2, (MODEL, "int8"): 1, ("other", "1"): 0}, {(MODEL, "prepared"): 40})
    two = metrics({(MODEL, "prepared"): 1}, {(MODEL, "prepared"): 12.5, (MODEL, "int8"): 90, ("other", "1"): 7})
    signals = read_signals([one, two, "not { prometheus"])
    assert signals[MODEL] == ModelSignal(held=4, idle_s=12.5)
    assert signals[MODEL].of("prepared") == ModelSignal(held=3, idle_s=12.5)
    assert signals[MODEL].of("int8") == ModelSignal(held=1, idle_s=90)
    assert signals[MODEL].of("unheard") == ModelSignal(held=0, idle_s=None)
    assert signals[MODEL].of(None) is signals[MODEL]
    assert signals["other"] == ModelSignal(held=0, idle_s=7)
    assert read_signals(["# nothing here\n"]) == {}


def test_only_min_replicas_zero_with_stop_after_s_is_a_stop_policy() -> None:
    models = {
        "models": [
            {"id": MODEL, "idle": {"min_replicas": 0, "stop_after_s": 60, "idle_after_s": 10}},
            {"id": "sleeps-only", "idle": {"min_replicas": 0, "idle_after_s": 10}},
            {"id": "keeps-one", "idle": {"min_replicas": 1, "idle_after_s": 10}},
            {"id": "default-min", "idle": {"stop_after_s": 60}},
            {"id": "no-workers-here", "idle": {"min_replicas": 0, "stop_after_s": 60}},
            {"id": "no-idle"},
        ]
    }
    workers: WorkerMap = {m: {None: ["w"]} for m in (MODEL, "sleeps-only", "keeps-one", "default-min", "no-idle")}
    mine: WorkerMap = {**workers, MODEL: {None: ["edge-0", "cloud-0"]}}
    assert stop_policies(models, mine) == [StopPolicy(MODEL, 60.0, ("edge-0", "cloud-0"))]
    assert stop_policies({}, workers) == []


def test_a_version_with_its_own_workers_is_its_own_pool_under_its_own_idle_or_its_models() -> None:
    models = {
        "models": [
            {
                "id": MODEL,
                "idle": {"min_replicas": 0, "stop_after_s": 60},
                "versions": [
                    {"name": "prepared", "idle": {"min_replicas": 1, "idle_after_s": 5}},  # never stopped
                    {"name": "canary", "idle": {"min_replicas": 0, "stop_after_s": 10}},
                    {"name": "int8"},  # the model's
                ],
            },
            {"id": "always-on", "versions": [{"name": "1", "idle": {"min_replicas": 0, "stop_after_s": 5}}]},
        ]
    }
    workers: WorkerMap = {
        MODEL: {"prepared": ["edge-0", "cloud-0"], "canary": ["edge-version-canary"], "int8": ["edge-version-int8"]},
        "always-on": {"1": ["edge-model-always-on"]},
    }
    assert stop_policies(models, workers) == [
        StopPolicy(MODEL, 10.0, ("edge-version-canary",), "canary"),
        StopPolicy(MODEL, 60.0, ("edge-version-int8",), "int8"),
        StopPolicy("always-on", 5.0, ("edge-model-always-on",), "1"),
    ]
    assert StopPolicy(MODEL, 10.0, ("w",), "canary").pool == f"{MODEL}@canary"


async def test_a_version_pool_stops_on_its_own_idleness_and_starts_on_its_own_held_requests() -> None:
    workers, log = FakeWorkers("edge-0", "edge-version-canary"), Log()
    policy = StopPolicy(MODEL, stop_after_s=30.0, workers=("edge-version-canary",), version="canary")
    s = Scaler([policy], workers, log=sink_logger(log))  # type: ignore[arg-type]
    s.tick(read_signals([metrics({}, {(MODEL, "prepared"): 0.5, (MODEL, "canary"): 31.0})]))
    await settle()
    assert workers.running == {"edge-0"} and workers.stopped == {"edge-version-canary"}  # the stable one serves on
    assert log.lines[-1]["event"] == "scale_to_zero" and log.lines[-1]["version"] == "canary"
    s.tick(read_signals([metrics({(MODEL, "prepared"): 3}, {(MODEL, "prepared"): 0.0, (MODEL, "canary"): 40.0})]))
    await settle()
    assert workers.stopped == {"edge-version-canary"}  # held for another version: not the canary's to serve
    s.tick(read_signals([metrics({(MODEL, "canary"): 1}, {(MODEL, "canary"): 0.0})]))
    await settle()
    assert workers.running == {"edge-0", "edge-version-canary"}
    assert [line["event"] for line in log.lines][-2:] == ["scale_from_zero", "scale_from_zero_done"]
    assert s.busy(f"{MODEL}@canary") is False


async def test_the_workers_stop_once_idle_reaches_stop_after_s() -> None:
    workers, log = FakeWorkers("edge-0", "edge-1", "cloud-0"), Log()
    s = scaler(workers, log)
    s.tick(read_signals([metrics({(MODEL, "p"): 0}, {(MODEL, "p"): 29.9})]))
    await settle()
    assert workers.calls == []
    s.tick({"other-model": ModelSignal(idle_s=1e6)})  # another model's idleness stops nothing here
    s.tick({MODEL: ModelSignal(held=0, idle_s=None)})  # no gauge: no news, nothing stopped
    await settle()
    assert workers.calls == []
    s.tick(read_signals([metrics({(MODEL, "p"): 0}, {(MODEL, "p"): 30.0})]))
    await settle()
    assert workers.stopped == {"edge-0", "edge-1", "cloud-0"} and workers.running == set()
    assert log.events() == ["scale_to_zero"]
    assert log.lines[0]["model"] == MODEL and log.lines[0]["workers"] == ["edge-0", "edge-1", "cloud-0"]
    s.tick({MODEL: ModelSignal(held=0, idle_s=100.0)})  # nothing left to stop
    await settle()
    assert [c for c in workers.calls if c[0] == "stop"] == [("stop", n) for n in ("edge-0", "edge-1", "cloud-0")]


async def test_a_held_request_starts_one_worker_and_a_second_start_never_overlaps() -> None:
    workers, log = FakeWorkers(), Log()
    workers.stopped = {"edge-0", "edge-1", "cloud-0"}
    workers.gate = asyncio.Event()
    s = scaler(workers, log)
    s.tick({MODEL: ModelSignal(held=0, idle_s=500.0)})
    await settle()
    assert workers.calls == []  # stopped and nobody waiting: stays at zero
    s.tick({MODEL: ModelSignal(held=3, idle_s=0.1)})
    await settle()
    assert workers.calls == [("start", "edge-0")]  # the first in start order
    for _ in range(3):  # still held while it loads: no second start
        s.tick({MODEL: ModelSignal(held=5, idle_s=0.2)})
        await settle()
    assert workers.calls == [("start", "edge-0")]
    workers.gate.set()
    await settle()
    assert workers.running == {"edge-0"}
    assert log.events() == ["scale_from_zero", "scale_from_zero_done"]
    assert log.lines[0]["held_requests"] == 3


async def test_the_rest_of_the_stopped_workers_follow_one_at_a_time_while_the_model_is_in_use() -> None:
    workers, log = FakeWorkers(), Log()
    workers.stopped = {"edge-0", "edge-1", "cloud-0"}
    s = scaler(workers, log)
    s.tick({MODEL: ModelSignal(held=2, idle_s=0.1)})
    await settle()
    assert workers.running == {"edge-0"}
    workers.gate = asyncio.Event()
    s.tick({MODEL: ModelSignal(held=0, idle_s=0.5)})  # served; in use (idle < stop_after_s): the next comes back
    await settle()
    s.tick({MODEL: ModelSignal(held=0, idle_s=0.6)})  # one start at a time
    await settle()
    assert workers.calls == [("start", "edge-0"), ("start", "edge-1")]
    workers.gate.set()
    await settle()
    s.tick({MODEL: ModelSignal(held=0, idle_s=0.7)})
    await settle()
    assert workers.running == {"edge-0", "edge-1", "cloud-0"}  # the mesh that was stopped, the other tier too
    assert log.events() == [
        "scale_from_zero",
        "scale_from_zero_done",
        "scale_up",
        "scale_up_done",
        "scale_up",
        "scale_up_done",
    ]


async def test_the_rest_stays_stopped_while_the_model_is_idle() -> None:
    workers, log = FakeWorkers(), Log()
    workers.stopped = {"edge-0", "edge-1", "cloud-0"}
    s = scaler(workers, log)
    s.tick({MODEL: ModelSignal(held=1, idle_s=0.1)})
    await settle()
    s.tick({MODEL: ModelSignal(held=0, idle_s=None)})  # no router says it is in use
    await settle()
    assert workers.calls == [("start", "edge-0")]


async def test_a_just_started_worker_is_not_stopped_on_a_stale_idle_gauge() -> None:
    workers, log = FakeWorkers(), Log()
    workers.stopped = {"edge-0", "edge-1", "cloud-0"}
    s = scaler(workers, log)
    s.tick({MODEL: ModelSignal(held=1, idle_s=400.0)})
    await settle()
    assert workers.running == {"edge-0"}
    s.tick({MODEL: ModelSignal(held=0, idle_s=400.0)})  # the router has not counted the request yet
    await settle()
    assert workers.running == {"edge-0"}
    assert ("stop", "edge-0") not in workers.calls


async def test_a_failed_start_is_logged_and_retried_only_after_its_backoff() -> None:
    workers, log = FakeWorkers(), Log()
    workers.stopped = {"edge-0"}
    workers.fail_starts = 2
    policy = StopPolicy(MODEL, stop_after_s=30.0, workers=("edge-0",))
    now = [1000.0]
    s = Scaler([policy], workers, log=sink_logger(log), backoff=Backoff(base_s=10.0, cap_s=40.0), clock=lambda: now[0])
    held = {MODEL: ModelSignal(held=1, idle_s=0.0)}
    s.tick(held)
    await settle()
    assert workers.calls == [("start", "edge-0")]
    failed = [line for line in log.lines if line["event"] == "scale_from_zero_failed"]
    assert len(failed) == 1 and failed[0]["level"] == "error" and failed[0]["retry_in_s"] == 10.0
    assert "exited with code 1" in str(failed[0]["error"])
    now[0] += 5
    s.tick(held)  # within the backoff: no new try
    await settle()
    assert len(workers.calls) == 1
    now[0] += 6
    s.tick(held)
    await settle()
    assert len(workers.calls) == 2
    second = [line for line in log.lines if line["event"] == "scale_from_zero_failed"][-1]
    assert second["failures"] == 2 and second["retry_in_s"] == 20.0  # doubled
    now[0] += 19.9
    s.tick(held)  # within the doubled backoff
    await settle()
    assert len(workers.calls) == 2
    now[0] += 0.2
    s.tick(held)
    await settle()
    assert workers.running == {"edge-0"} and len(workers.calls) == 3
    assert log.events()[-1] == "scale_from_zero_done"


async def test_a_crashed_worker_is_left_to_the_restart_policy() -> None:
    workers, log = FakeWorkers(), Log()  # not running, not stopped on purpose: restarting
    s = scaler(workers, log)
    s.tick({MODEL: ModelSignal(held=2, idle_s=0.0)})
    await settle()
    assert workers.calls == []


async def test_closing_cancels_a_start_under_way() -> None:
    workers, log = FakeWorkers(), Log()
    workers.stopped = {"edge-0"}
    workers.gate = asyncio.Event()
    s = scaler(workers, log)
    s.tick({MODEL: ModelSignal(held=1, idle_s=0.0)})
    await settle()
    assert s.busy(MODEL)
    await s.close()
    assert not s.busy(MODEL)
    with pytest.raises(KeyError):
        s.busy("unknown")
