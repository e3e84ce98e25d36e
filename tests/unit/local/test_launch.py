"""`meshserve serve` and `meshserve health`: the container entry points."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import cli
from services.common.serving import grpc_options
from services.local import launch

MESHSERVE = [sys.executable, "-m", "services.cli"]


def test_every_service_module_exists() -> None:
    import importlib.util

    for service, module in launch.SERVICES.items():
        assert importlib.util.find_spec(module) is not None, service
        assert launch.module_of(service) == module


def test_unknown_service_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of gateway, gateway-http, router"):
        launch.module_of("edge")


def test_serve_execs_the_service_module_with_its_settings() -> None:
    # An invalid setting proves the real gateway started (it validates its env and exits 2).
    env = {**os.environ, "MESHSERVE_GATEWAY_MAX_PROMPT_CHARS": "-5", "MESHSERVE_GATEWAY_PORT": "0"}
    done = subprocess.run([*MESHSERVE, "serve", "gateway"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "MESHSERVE_GATEWAY_MAX_PROMPT_CHARS" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_a_service_whose_port_is_taken_exits_2_with_one_line_naming_the_setting() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {
            **os.environ,
            "MESHSERVE_GATEWAY_PORT": str(port),
            "MESHSERVE_GATEWAY_API_KEYS": "dev:" + "0" * 64,
            "MESHSERVE_GATEWAY_ROUTER_ADDRESS": "127.0.0.1:1",
        }
        done = subprocess.run([*MESHSERVE, "serve", "gateway"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"gateway: cannot listen on 127.0.0.1:{port}: the port is in use (or the host is not this machine's); "
        "set MESHSERVE_GATEWAY_PORT to a free port (0 picks one)"
    )


def test_serve_rejects_an_unknown_service(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "nope"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


async def _health_server() -> tuple[object, health.aio.HealthServicer, int]:
    import grpc

    server = grpc.aio.server(options=grpc_options())
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, port


async def test_health_exit_code_follows_the_serving_status(capsys: pytest.CaptureFixture[str]) -> None:
    server, servicer, port = await _health_server()
    try:
        address = f"127.0.0.1:{port}"
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await asyncio.to_thread(cli.main, ["health", address]) == 0

        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await asyncio.to_thread(cli.main, ["health", address]) == 1
        assert "reports NOT_SERVING" in capsys.readouterr().err

        await servicer.set("meshserve.v1.Inference", health_pb2.HealthCheckResponse.SERVING)
        assert await asyncio.to_thread(cli.main, ["health", address, "--service", "meshserve.v1.Inference"]) == 0

        capsys.readouterr()
        assert await asyncio.to_thread(cli.main, ["health", address, "--service", "meshserve.v1.Nope"]) == 1
        err = capsys.readouterr().err
        assert "knows no health service 'meshserve.v1.Nope'" in err and "did not answer" not in err
    finally:
        await server.stop(None)  # type: ignore[attr-defined]


def test_health_of_nothing_listening_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from services.common.processes import free_port

    address = f"127.0.0.1:{free_port()}"
    assert cli.main(["health", address, "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert f"{address} did not answer (UNAVAILABLE)" in err


def test_help_lists_the_entry_points() -> None:
    done = subprocess.run([*MESHSERVE, "--help"], capture_output=True, text=True, timeout=60)
    assert all(name in done.stdout for name in ("serve", "health", "frontdoor"))
