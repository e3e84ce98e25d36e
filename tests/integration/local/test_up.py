"""`meshserve up` as a real subprocess: a service that fails to start, and Ctrl-C while starting.

Every child of the run carries a marker in its environment (the mesh passes the launcher's
environment on), so the tests can tell that none is left once `meshserve up` has exited.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

MARKER = "MESHSERVE_TEST_UP_RUN"
UP = ["up", "--no-envoy", "--port", "0"]


def _running(marker: str) -> list[int]:
    """Live processes (zombies have an empty environ) whose environment carries ``marker``."""
    tag = f"{MARKER}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:  # exited meanwhile, or not ours
                continue
            if tag in environ.split(b"\0"):
                pids.append(int(entry.name))
    return pids


@asynccontextmanager
async def _up(tmp_path: Path, *argv: str, **env: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """``meshserve up ARGV`` with ``env`` added; yields the process and its children's marker."""
    marker = uuid.uuid4().hex
    full_env = {**os.environ, MARKER: marker, "MESHSERVE_STATE_FILE": str(tmp_path / "mesh.json"), **env}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        *UP,
        *argv,
        env=full_env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        yield proc, marker
    finally:
        if proc.returncode is None:  # the test failed: leave nothing behind
            proc.kill()
            await proc.wait()


async def _meshserve(state_file: Path, *argv: str, timeout_s: float = 60) -> str:
    """``meshserve ARGV`` as a user runs it (the mesh found in ``state_file``); its output, after
    asserting that it exited 0."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        *argv,
        env={**os.environ, "MESHSERVE_STATE_FILE": str(state_file)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode == 0, (out + err).decode()[-2000:]
    return out.decode()


async def _read_until(stream: asyncio.StreamReader, found: Callable[[str], bool]) -> list[str]:
    lines: list[str] = []
    while line := (await stream.readline()).decode():
        lines.append(line)
        if found(line):
            return lines
    raise AssertionError(f"stream ended before the line looked for: {lines[-5:]}")


async def test_a_service_that_fails_to_start_ends_in_one_line_exit_1_and_no_children(tmp_path: Path) -> None:
    missing = tmp_path / "no-model"
    async with _up(
        tmp_path, "--edge-workers", "1", "--cloud-workers", "0", MESHSERVE_EDGE_WORKER_MODEL_DIR=str(missing)
    ) as (
        proc,
        marker,
    ):
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    stderr = err.decode()
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr
    failure = [line for line in stderr.splitlines() if "did not start" in line]
    assert failure == [
        "meshserve up: the mesh did not start: edge-0 exited with code 2 before serving; "
        "see its log (the lines marked edge-0)"
    ]
    edge_log = [line for line in out.decode().splitlines() if line.startswith("edge-0 ")]
    assert any(f"no onnxruntime-genai model at {missing}" in line for line in edge_log)  # the reason, in its log
    assert _running(marker) == [], "redis-server and the gateway were stopped"


async def test_ctrl_c_while_starting_stops_every_child_and_exits(tmp_path: Path) -> None:
    # No workers: the gateway's router never reports SERVING, so the start would wait its whole
    # start timeout (240 s); Ctrl-C must end it at once instead.
    async with _up(tmp_path, "--edge-workers", "0", "--cloud-workers", "0") as (proc, marker):
        assert proc.stdout is not None
        await asyncio.wait_for(
            _read_until(proc.stdout, lambda line: line.startswith("gateway ") and '"service_started"' in line), 120
        )
        assert len(_running(marker)) >= 2, "redis-server and the gateway run"
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 60)  # bounded: far below the start timeout
    stderr = err.decode()
    assert proc.returncode == 0, stderr  # as a Ctrl-C once the mesh is up
    assert "Traceback" not in stderr
    assert "stopping what has started" in stderr
    assert _running(marker) == []
    assert not (tmp_path / "mesh.json").exists()  # it never came up: no state for `meshserve status`


@pytest.mark.parametrize(("flag", "whose"), [("--port", "the gateway's"), ("--http-port", "Envoy's")])
async def test_a_busy_port_ends_up_at_once_with_one_line_naming_the_flag(tmp_path: Path, flag: str, whose: str) -> None:
    # What a second `make run` beside a running mesh meets: 50051 and 8080 are taken.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["up", "--edge-workers", "0", "--cloud-workers", "0", "--port", "0", "--http-port", "0", flag, str(port)]
        env = {**os.environ, "MESHSERVE_STATE_FILE": str(tmp_path / "mesh.json")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.cli",
            *argv,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1, err.decode()
    assert err.decode().strip() == (
        f"meshserve up: port {port} ({whose}) is in use on 127.0.0.1; is a mesh already running "
        f"(`meshserve status`)? Stop it, or pass {flag} with a free port (0 picks one)"
    )
    assert out.decode() == ""  # checked before anything started


async def test_the_banners_commands_work_as_printed_without_meshserve_on_path(tmp_path: Path) -> None:
    """`make run` starts `.venv/bin/meshserve up` and the venv is not on PATH: the banner's commands
    must still run when typed as printed, from where `meshserve up` was started."""
    path = "/usr/local/bin:/usr/bin:/bin"  # no venv on it; redis-server is in /usr/bin
    async with _up(tmp_path, "--edge-workers", "1", "--cloud-workers", "0", PATH=path) as (proc, _marker):
        assert proc.stderr is not None
        banner = await asyncio.wait_for(_read_until(proc.stderr, lambda line: "Ctrl-C stops" in line), 240)
        printed = {
            key: line.split(":", 1)[1].strip() for line in banner for key in ("try", "live view") if f"  {key}:" in line
        }
        assert not printed["try"].startswith("meshserve "), printed  # not on this PATH
        status = [*shlex.split(printed["live view"]), "--once"]
        chat = [*shlex.split(printed["try"]), "--max-tokens", "4"]
        for argv in (status, chat):
            run = await asyncio.create_subprocess_exec(
                *argv,
                env={**os.environ, "PATH": path, "MESHSERVE_STATE_FILE": str(tmp_path / "mesh.json")},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await asyncio.wait_for(run.communicate(), 120)
            assert run.returncode == 0, (argv, out.decode()[-2000:])
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
