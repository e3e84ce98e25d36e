"""The compose TP group's command, run as it is written: torchrun starts `meshserve serve gpu-worker`.

At compose's default TP size (1): TP=3 over gloo works through the same command too, but takes
minutes on a small CI machine; tests/integration/gpu_worker/test_tp.py covers TP=3 itself.

Only what a container changes is adapted: loopback and a free port instead of 0.0.0.0:50061, no
metrics port, no router to register with, the local models directory. The worker must load the real
model, pass the compose healthcheck command (`meshserve health`), and drain on SIGTERM sent to
torchrun (as `docker stop` sends it to the container).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import grpc
import pytest

from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.processes import free_port, wait_for_health
from tests.unit.deploy import commands, compose_model
from tests.worker_helpers import generate

pytestmark = pytest.mark.integration
PROMPT = [1, 504, 3458, 314, 253]  # token ids of the real tokenizer's vocabulary


async def test_compose_tp_group_command_serves_and_drains() -> None:
    service = compose_model.load()["services"]["cloud-0"]
    argv = compose_model.command(service)
    launcher = commands.parse(argv).torchrun
    assert launcher is not None and launcher.nproc_per_node == "1"  # compose's default TP size
    port = free_port()
    env = {k: v for k, v in compose_model.service_env(service).items() if k != "MESHSERVE_MODELS_DIR"}
    env.update(
        {
            "MESHSERVE_GPU_WORKER_HOST": "127.0.0.1",
            "MESHSERVE_GPU_WORKER_PORT": str(port),
            "MESHSERVE_GPU_WORKER_METRICS_PORT": "-1",
            "MESHSERVE_GPU_WORKER_ROUTER_ADDRESS": "",
            "MESHSERVE_GPU_WORKER_SHUTDOWN_GRACE_S": "2",
            "MESHSERVE_GPU_WORKER_WARMUP": "false",  # not what this test is about; saves time
        }
    )
    bin_dir = str(Path(sys.executable).parent)  # torchrun and meshserve, as on the image's PATH
    full_env = {**os.environ, **env, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=full_env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    lines: list[str] = []

    async def relay() -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            lines.append(line.decode(errors="replace").rstrip())

    relaying = asyncio.create_task(relay())
    try:
        await wait_for_health(f"127.0.0.1:{port}", 240)
        check = [a.replace("127.0.0.1:50061", f"127.0.0.1:{port}") for a in service["healthcheck"]["test"][1:]]
        assert check[:2] == ["meshserve", "health"]
        done = await asyncio.create_subprocess_exec(*check, env=full_env)
        assert await done.wait() == 0
        assert any('"worker_ready"' in line and '"cloud-0"' in line for line in lines)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # the group generates
            result = await generate(worker_pb2_grpc.WorkerStub(channel), PROMPT, max_tokens=4, temperature=0)
        assert result.final is not None and result.final.completion_tokens == len(result.token_ids) > 0
        assert result.sequences == list(range(len(result.sequences)))
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 90)
        await relaying
    events = [line for line in lines if '"service_draining"' in line or '"service_stopped"' in line]
    assert len(events) == 2, "\n".join(lines[-30:])  # the worker drained, then stopped
