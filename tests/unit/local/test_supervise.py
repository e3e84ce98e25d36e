"""The supervisor of ``meshserve up`` (services/local/supervise.py) over tiny shell children with
millisecond backoffs: a killed child comes back and its exit is recorded, a crash loop is reported
once and keeps being retried, a child that fails to serve counts as exiting again, and closing the
supervisor restarts nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest

from services.common.processes import ServiceProcess
from services.local.supervise import SUPERVISOR, RestartPolicy, Supervisor, exit_reason

FAST = RestartPolicy(base_s=0.01, cap_s=0.04, reset_after_s=30.0, loop_restarts=3, loop_window_s=60.0)


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __call__(self, name: str, line: str) -> None:
        self.lines.append((name, line))

    def events(self, event: str) -> list[dict[str, object]]:
        found = [json.loads(line) for name, line in self.lines if name == SUPERVISOR]
        return [e for e in found if e["event"] == event]


async def noop_ready(proc: ServiceProcess) -> None:
    return None


async def _until(predicate: object, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)  # the supervisor's own tasks run meanwhile


def test_exit_reasons_and_backoff() -> None:
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(1) == "exit code 1"
    assert exit_reason(0) == "exit code 0"
    policy = RestartPolicy()
    assert [policy.delay_s(n) for n in (1, 2, 3, 4, 5, 6, 9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


async def test_a_killed_child_is_restarted_and_its_exit_recorded() -> None:
    log = Log()
    changes: list[str] = []
    proc = ServiceProcess("svc", ["sh", "-c", "exec sleep 60"], {}, log)
    await proc.spawn()
    assert proc.proc is not None
    first = proc.proc.pid
    sup = Supervisor(log, FAST, on_change=lambda: changes.append(sup.records["svc"].state))
    sup.watch(proc, noop_ready)
    try:
        proc.signal(signal.SIGKILL)
        await _until(lambda: sup.records["svc"].restarts == 1 and sup.records["svc"].state == "running")
        assert proc.proc.pid != first and proc.proc.returncode is None
        record = sup.snapshot()["svc"]
        assert record["last_exit"] == "killed by SIGKILL" and record["pid"] == proc.proc.pid
        assert changes == ["restarting", "running"]
        assert log.events("service_exited")[0]["exit"] == "killed by SIGKILL"
        assert not log.events("service_crash_loop")
    finally:
        await sup.close()
        await proc.stop(5)


async def test_a_crash_loop_is_reported_once_and_retried_at_the_capped_backoff() -> None:
    log = Log()
    proc = ServiceProcess("bad", ["sh", "-c", "exit 3"], {}, log)
    await proc.spawn()
    sup = Supervisor(log, FAST)
    sup.watch(proc, noop_ready)
    try:
        await _until(lambda: sup.records["bad"].restarts >= 5)
        record = sup.records["bad"]
        assert record.state == "crash loop" and record.last_exit == "exit code 3"
        loops = log.events("service_crash_loop")
        assert len(loops) == 1 and loops[0]["level"] == "error" and loops[0]["service"] == "bad"
        delays = [e["restart_in_s"] for e in log.events("service_exited")]
        assert delays[:3] == [0.01, 0.02, 0.04] and set(delays[3:]) == {0.04}  # capped, still retried
    finally:
        await sup.close()
        await proc.stop(5)


async def test_a_child_that_does_not_serve_after_a_restart_counts_as_exiting_again() -> None:
    log = Log()
    proc = ServiceProcess("slow", ["sh", "-c", "exec sleep 60"], {}, log)
    await proc.spawn()
    failures = 0

    async def ready(p: ServiceProcess) -> None:
        nonlocal failures
        if failures < 2:
            failures += 1
            raise TimeoutError("slow did not report SERVING within 1 s")

    sup = Supervisor(log, RestartPolicy(base_s=0.01, cap_s=0.04))
    sup.watch(proc, ready)
    try:
        proc.signal(signal.SIGKILL)
        await _until(lambda: sup.records["slow"].restarts == 3 and sup.records["slow"].state == "running")
        assert [e["error"] for e in log.events("service_restart_failed")] == [
            "slow did not report SERVING within 1 s"
        ] * 2
        assert proc.proc is not None and proc.proc.returncode is None
        exits = [e["exit"] for e in log.events("service_exited")]
        assert (
            exits
            == ["killed by SIGKILL"] + ["did not serve after a restart: slow did not report SERVING within 1 s"] * 2
        )
    finally:
        await sup.close()
        await proc.stop(5)


@pytest.mark.parametrize("when", ["running", "backing_off"])
async def test_nothing_is_restarted_once_the_supervisor_is_closed(when: str) -> None:
    log = Log()
    proc = ServiceProcess("svc", ["sh", "-c", "exec sleep 60"], {}, log)
    await proc.spawn()
    sup = Supervisor(log, RestartPolicy(base_s=30.0))
    sup.watch(proc, noop_ready)
    if when == "backing_off":
        proc.signal(signal.SIGKILL)
        await _until(lambda: sup.records["svc"].state == "restarting")
    await asyncio.wait_for(sup.close(), 5)
    await proc.stop(5)  # as Mesh.stop does after closing the supervisor
    await asyncio.sleep(0.05)
    assert sup.records["svc"].restarts == 0
    assert proc.proc is not None and proc.proc.returncode is not None
    with pytest.raises(RuntimeError, match="closed"):
        sup.watch(proc, noop_ready)


async def test_a_restart_runs_in_the_warm_spare_with_the_current_environment() -> None:
    log = Log()
    env = {**os.environ, "SPARE_ECHO": "first"}
    proc = ServiceProcess("spare", [sys.executable, "-m", "tests.unit.local.spare_service"], env, log)
    assert proc.can_stand_by and not ServiceProcess("x", ["sh", "-c", "true"], {}, log).can_stand_by
    await proc.spawn()
    sup = Supervisor(log, FAST)
    sup.watch(proc, noop_ready, standby=True)

    def running() -> list[dict[str, object]]:
        found = [json.loads(line) for name, line in log.lines if name == "spare" and line.startswith("{")]
        return [e for e in found if e.get("event") == "spare_service_running"]

    try:
        await _until(lambda: proc._standby is not None and len(running()) == 1)
        assert proc._standby is not None and proc.proc is not None
        spare = proc._standby
        proc.env["SPARE_ECHO"] = "second"  # as the mesh pins a port before a restart
        proc.signal(signal.SIGKILL)
        await _until(lambda: sup.records["spare"].restarts == 1 and sup.records["spare"].state == "running")
        assert proc.proc.pid == spare.pid  # the spare became the service
        await _until(lambda: len(running()) == 2)
        assert running()[1] == {"event": "spare_service_running", "pid": spare.pid, "echo": "second"}
        await _until(lambda: proc._standby is not None)  # and a new spare waits for the next restart
        assert proc._standby is not None and proc._standby.pid != spare.pid
        again = proc._standby
    finally:
        await sup.close()
        await proc.stop(5)
    assert again.returncode is not None and proc._standby is None  # stopping the service stops its spare


async def test_a_child_stopped_on_purpose_is_not_restarted_until_started_again() -> None:
    log = Log()
    changes: list[str] = []
    proc = ServiceProcess("edge-0", ["sh", "-c", "exec sleep 60"], {}, log)
    await proc.spawn()
    assert proc.proc is not None
    first = proc.proc
    sup = Supervisor(log, FAST, on_change=lambda: changes.append(sup.records["edge-0"].state))
    sup.watch(proc, noop_ready)
    try:
        assert sup.is_running("edge-0") and not sup.is_stopped("edge-0")
        assert await sup.stop_service("edge-0", "idle", grace_s=5)
        assert first.returncode is not None  # it was stopped (SIGTERM), and stays so
        for _ in range(20):  # well past the restart backoff (10 ms): nothing restarts it
            await asyncio.sleep(0.01)
        record = sup.snapshot()["edge-0"]
        assert record["state"] == "stopped (idle)" and record["pid"] is None and record["restarts"] == 0
        assert record["stopped_at"]
        assert sup.is_stopped("edge-0") and not sup.is_running("edge-0")
        assert proc.proc is first and not log.events("service_exited")
        assert not await sup.stop_service("edge-0")  # already stopped: nothing to do

        await sup.start_service("edge-0")
        assert proc.proc is not first and proc.proc.returncode is None
        assert sup.records["edge-0"].state == "running" and sup.is_running("edge-0")
        assert changes == ["stopping (idle)", "stopped (idle)", "starting", "running"]
        assert [e["event"] for e in log.events("service_stopped") + log.events("service_started_again")] == [
            "service_stopped",
            "service_started_again",
        ]
        second = proc.proc
        second.kill()  # started again, it is supervised again: a crash is restarted
        await _until(lambda: sup.records["edge-0"].restarts == 1 and sup.records["edge-0"].state == "running")
        assert proc.proc is not second
    finally:
        await sup.close()
        await proc.stop(5)


async def test_a_failed_start_from_stopped_leaves_it_stopped_and_raises() -> None:
    log = Log()
    proc = ServiceProcess("edge-0", ["sh", "-c", "exec sleep 60"], {}, log)
    await proc.spawn()
    attempts = 0

    async def ready(p: ServiceProcess) -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise TimeoutError("edge-0 did not report SERVING within 1 s")

    sup = Supervisor(log, FAST)
    sup.watch(proc, ready)
    try:
        assert await sup.stop_service("edge-0")
        with pytest.raises(TimeoutError):
            await sup.start_service("edge-0")
        assert proc.proc is not None and proc.proc.returncode is not None  # killed, not left half up
        assert sup.records["edge-0"].state == "stopped (idle)" and sup.is_stopped("edge-0")
        await sup.start_service("edge-0")
        assert sup.records["edge-0"].state == "running" and proc.proc.returncode is None
    finally:
        await sup.close()
        await proc.stop(5)


async def test_only_a_running_child_is_stopped_on_purpose() -> None:
    log = Log()
    proc = ServiceProcess("bad", ["sh", "-c", "exit 3"], {}, log)
    await proc.spawn()
    sup = Supervisor(log, RestartPolicy(base_s=5.0, cap_s=5.0))
    sup.watch(proc, noop_ready)
    try:
        await _until(lambda: sup.records["bad"].state == "restarting")
        assert not await sup.stop_service("bad")  # the restart policy's
        assert sup.records["bad"].state == "restarting" and not sup.is_stopped("bad")
    finally:
        await sup.close()
        await proc.stop(5)
