"""`meshserve status --once` against the real mesh shows every replica, its tier, health and tokens.

Named to run before test_mesh.py, whose last test stops the edge workers of the shared mesh.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import Mesh
from tests.e2e.conftest import auth
from tests.helpers import RedisServer

pytestmark = pytest.mark.e2e


async def status(*argv: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "status",
        "--once",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_status_once_shows_the_replicas_per_tier_with_load_tokens_caches_and_traffic(
    gateway: inference_pb2_grpc.InferenceStub, mesh: Mesh
) -> None:
    request = pb.GenerateRequest(
        prompt="Status e2e: name a color",
        sampling=pb.SamplingParams(max_tokens=4),
        routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
    )
    frames = [f async for f in gateway.Generate(request, metadata=auth())]
    served_by = frames[-1].final.route.worker_id
    state = mesh.describe()
    metrics = [f"{name}={url}" for name, url in state["metrics"].items()]  # type: ignore[attr-defined]
    for _ in range(5):  # a health probe that timed out on a loaded machine shows a replica down for a second
        text = await status("--router", mesh.router_address, "--cache", mesh.cache_address, "--metrics", *metrics)
        if "edge: 2/2 replicas healthy" in text and "cloud: 1/1 replicas healthy" in text:
            break

    assert f"router {mesh.router_address} SERVING" in text
    assert "edge: 2/2 replicas healthy" in text and "cloud: 1/1 replicas healthy" in text
    for tier in ("edge", "cloud"):
        for proc in mesh.workers(tier):
            row = next(line for line in text.splitlines() if proc.address in line)
            assert row.split("│")[3].strip() == "up", row
    served_row = next(line for line in text.splitlines() if line.startswith(f"│ {served_by} "))
    assert int(served_row.split("│")[8].strip()) >= frames[-1].final.usage.completion_tokens  # tokens generated
    assert "response" in text and "kv prefix" in text  # cache hit ratios from the cache service
    requests = next(line for line in text.splitlines() if line.startswith("traffic: "))
    assert int(requests.split("requests ")[1].split()[0]) >= 1
    assert "unreachable" not in text


async def test_status_reports_an_unreachable_router_in_one_line(mesh: Mesh) -> None:
    text = await status("--router", "127.0.0.1:1", "--cache", "", "--metrics")
    assert "unreachable: router 127.0.0.1:1: UNAVAILABLE" in text


async def test_status_alone_watches_the_mesh_meshserve_up_started(redis_srv: RedisServer, tmp_path: Path) -> None:
    state = tmp_path / "mesh.json"
    env = {**os.environ, "MESHSERVE_STATE_FILE": str(state)}
    argv = ["up", "--no-envoy", "--port", "0", "--edge-workers", "1", "--cloud-workers", "0"]
    up = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        *argv,
        "--redis-url",
        redis_srv.url,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while not state.exists():  # written once every service is healthy
            assert up.returncode is None and time.monotonic() < deadline, "meshserve up did not come up"
            await asyncio.sleep(0.2)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.cli",
            "status",
            "--once",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        text = out.decode()
        recorded = json.loads(state.read_text())
        assert f"router {recorded['router']} SERVING" in text
        assert "edge: 1/1 replicas healthy" in text and "cloud: no replicas" in text
        assert "response" in text and "traffic: requests" in text and "unreachable" not in text
        assert "services: 4 supervised, 0 restarted" in text  # gateway, edge-0, cache, batch (Redis is given)

        # kill -9 of a supervised service: `meshserve up` restarts it, and `status` says so.
        os.kill(int(recorded["services"]["cache"]["pid"]), signal.SIGKILL)
        while True:
            record = json.loads(state.read_text())["services"]["cache"]
            if record["restarts"] == 1 and record["state"] == "running":
                break
            assert up.returncode is None and time.monotonic() < deadline, (
                f"the cache service did not come back: {record}"
            )
            await asyncio.sleep(0.2)  # the state file has no change event to wait on
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "status", "--once", env=env, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        row = next(line for line in out.decode().splitlines() if line.startswith("│ cache "))
        assert "running" in row and "killed by SIGKILL" in row, out.decode()
        assert "services: 4 supervised, 1 restarted" in out.decode()
    finally:
        up.send_signal(signal.SIGINT)
        await asyncio.wait_for(up.wait(), 60)
    assert up.returncode == 0
    assert not state.exists()  # removed when the mesh stops
