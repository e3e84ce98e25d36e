"""`meshserve up --min-replicas 0 --stop-after-s S` as a real subprocess: scale to zero and back.

The real mesh (edge workers, the router in the gateway): once the model has had no request for S
seconds, the local scaler stops the edge workers' processes (the supervisor does not restart them, the
state file and `meshserve status --json` say they are stopped); then a request arrives, the router holds
it, the scaler sees the held gauge and starts a worker, which registers by heartbeat, and the request is
answered by it. With a second version (`--edge-version`), each version is its own pool: a request held
for that version starts that version's worker, and the other version's stays stopped.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import DEV_API_KEY
from tests.integration.local.test_up import _meshserve, _read_until, _running, _up

pytestmark = pytest.mark.integration
STOP_AFTER_S = "3"


def _read(state_file: Path) -> dict[str, object]:
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):  # between two rewrites
        return {}
    return state if isinstance(state, dict) else {}


def _gone(pid: int) -> bool:
    """No such process any more (or only its zombie)."""
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return True


async def _until_state(
    state_file: Path, found: Callable[[dict[str, object]], bool], timeout_s: float
) -> dict[str, object]:
    """The state file's content once ``found`` holds for it (`meshserve up` rewrites it on every change)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        state = _read(state_file)
        if state and found(state):
            return state
        assert loop.time() < deadline, f"state not reached in {timeout_s} s: {state.get('services')}"
        await asyncio.sleep(0.1)  # polling a file the mesh rewrites, not waiting for readiness


async def _status(state_file: Path) -> dict[str, dict[str, Any]]:
    """`meshserve status --json`'s replicas by name, as a user runs it (the mesh found in the state file)."""
    out = await _meshserve(state_file, "status", "--json", timeout_s=120)
    return {str(r["name"]): r for r in json.loads(out)["replicas"]}


def _edge(state: dict[str, object], name: str = "edge-0") -> dict[str, object]:
    services = state.get("services")
    assert isinstance(services, dict)
    record = services[name]
    assert isinstance(record, dict)
    return record


async def test_an_idle_model_is_stopped_and_a_request_starts_it_from_zero(tmp_path: Path) -> None:
    argv = ["--edge-workers", "2", "--cloud-workers", "0", "--min-replicas", "0", "--stop-after-s", STOP_AFTER_S]
    state_file = tmp_path / "mesh.json"
    # a start from zero on a loaded 2-core machine may take longer than the 60 s default deadline
    async with _up(tmp_path, *argv, MESHSERVE_ROUTER_WAKE_DEADLINE_S="240") as (proc, marker):
        assert proc.stderr is not None and proc.stdout is not None
        log: list[str] = []

        async def drain(stream: asyncio.StreamReader) -> None:  # the merged log: never let its pipe fill
            while line := await stream.readline():
                log.append(line.decode())

        draining = asyncio.create_task(drain(proc.stdout))
        banner = await asyncio.wait_for(_read_until(proc.stderr, lambda line: "Ctrl-C stops" in line), 240)
        names = "edge-0, edge-1"
        said = f"scale from zero: {DEFAULT_MODEL_ID}'s workers ({names}) stop after {STOP_AFTER_S} s without a request"
        assert any(said in line for line in banner), banner
        stderr = asyncio.create_task(drain(proc.stderr))
        first = _read(state_file)
        pid = _edge(first)["pid"]
        assert isinstance(pid, int)

        both_stopped = lambda s: all(_edge(s, n)["state"] == "stopped (idle)" for n in ("edge-0", "edge-1"))  # noqa: E731
        stopped = await _until_state(state_file, both_stopped, 120)
        assert _edge(stopped)["pid"] is None and _edge(stopped)["restarts"] == 0
        assert _gone(pid)  # the worker's process itself, not only its registration
        replicas = await _status(state_file)
        assert replicas["edge-0"]["model_state"] == "stopped"

        async with grpc.aio.insecure_channel(str(first["gateway"])) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=4, temperature=0.0))
            meta = (("authorization", f"Bearer {DEV_API_KEY}"),)
            frames = [f async for f in stub.Generate(request, metadata=meta, timeout=300)]
        assert frames[-1].HasField("final") and frames[-1].final.usage.completion_tokens >= 1
        assert frames[-1].final.route.worker_id == "edge-0"
        started = _read(state_file)
        assert _edge(started)["state"] == "running" and _edge(started)["restarts"] == 0  # started, not a crash
        awake = (await _status(state_file))["edge-0"]  # its own Worker.Stats now
        assert awake["model_state"] == "awake" and awake["resident_bytes"] > 0 and awake["healthy"]
        # the other replica that was stopped comes back too while the model is in use
        back = await _until_state(state_file, lambda s: _edge(s, "edge-1")["state"] == "running", 120)
        assert _edge(back, "edge-1")["restarts"] == 0

        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 90) == 0
        await asyncio.wait_for(asyncio.gather(draining, stderr), 30)
        events = [json.loads(line.split("|", 1)[1])["event"] for line in log if line.startswith("scaler ")]
        expected = ["scale_to_zero", "scale_from_zero", "scale_from_zero_done", "scale_up", "scale_up_done"]
        assert events[:5] == expected, events
        assert _running(marker) == []


async def test_each_version_is_its_own_pool_a_request_for_one_starts_only_its_worker(tmp_path: Path) -> None:
    int8 = model_paths().root / "draft-int8"
    argv = ["--edge-workers", "1", "--cloud-workers", "0", "--edge-version", f"int8={int8}"]
    argv += ["--min-replicas", "0", "--stop-after-s", STOP_AFTER_S]
    state_file = tmp_path / "mesh.json"
    async with _up(tmp_path, *argv, MESHSERVE_ROUTER_WAKE_DEADLINE_S="240") as (proc, marker):
        assert proc.stderr is not None and proc.stdout is not None
        log: list[str] = []

        async def drain(stream: asyncio.StreamReader) -> None:
            while line := await stream.readline():
                log.append(line.decode())

        draining = asyncio.create_task(drain(proc.stdout))
        banner = "".join(await asyncio.wait_for(_read_until(proc.stderr, lambda line: "Ctrl-C stops" in line), 240))
        assert f"scale from zero: {DEFAULT_MODEL_ID}@prepared's workers (edge-0) stop after" in banner
        assert f"scale from zero: {DEFAULT_MODEL_ID}@int8's workers (edge-version-int8) stop after" in banner
        stderr = asyncio.create_task(drain(proc.stderr))
        names = ("edge-0", "edge-version-int8")
        first = await _until_state(
            state_file, lambda s: all(_edge(s, n)["state"] == "stopped (idle)" for n in names), 120
        )

        await _meshserve(state_file, "models", "rollout", DEFAULT_MODEL_ID, "--weights", "prepared=0,int8=100")
        async with grpc.aio.insecure_channel(str(first["gateway"])) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=4, temperature=0.0))
            meta = (("authorization", f"Bearer {DEV_API_KEY}"),)
            frames = [f async for f in stub.Generate(request, metadata=meta, timeout=300)]
        assert frames[-1].HasField("final") and frames[-1].final.route.worker_id == "edge-version-int8"
        after = _read(state_file)
        assert _edge(after, "edge-version-int8")["state"] == "running"
        assert _edge(after, "edge-0")["state"] == "stopped (idle)"  # the prepared build had no request

        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 90) == 0
        await asyncio.wait_for(asyncio.gather(draining, stderr), 30)
        events = [json.loads(line.split("|", 1)[1]) for line in log if line.startswith("scaler ")]
        starts = [(e["version"], e["worker"]) for e in events if e["event"] == "scale_from_zero"]
        assert starts == [("int8", "edge-version-int8")], events
        assert sorted(e["version"] for e in events if e["event"] == "scale_to_zero")[:2] == ["int8", "prepared"]
        assert _running(marker) == []
