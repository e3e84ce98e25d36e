"""`meshserve frontdoor` (the compose `envoy` service / Kubernetes `frontdoor` Deployment) as a process.

A real gateway (in front of the fake router) is named by DNS (`localhost:<port>`), as compose and
Kubernetes name `gateway:50051`; the command resolves it, starts Envoy and the HTTP adapter, and
serves gRPC and the OpenAI HTTP API on one port until SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest

from services import cli
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.processes import free_port, wait_for_health
from services.controlplane.server import resolve
from tests.helpers import RedisServer
from tests.integration.frontdoor.conftest import API_KEY, WORDS, FakeRouter, start_gateway, start_router

pytestmark = pytest.mark.integration


def test_resolve_turns_names_into_ipv4_endpoints() -> None:
    assert resolve(["localhost:50051", "127.0.0.1:7"]) == ["127.0.0.1:7", "127.0.0.1:50051"]
    assert resolve(["no-such-host.invalid:50051"]) == []  # not resolvable yet: no replica
    with pytest.raises(ValueError, match="must be host:port"):
        resolve(["gateway"])


@pytest.fixture
async def gateway_port(redis_srv: RedisServer) -> AsyncIterator[int]:
    router_server = await start_router(FakeRouter())
    gateway = await start_gateway(router_server.port, redis_srv.url)
    try:
        yield gateway.port
    finally:
        await gateway.stop()
        await router_server.stop()


async def test_frontdoor_command_serves_grpc_and_http_until_sigterm(gateway_port: int) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "frontdoor",
        "--gateways",
        f"localhost:{gateway_port}",
        "--http-port",
        str(port),
        "--listen-host",
        "127.0.0.1",
        "--resolve-interval",
        "0.5",
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    logs: list[str] = []

    async def relay() -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            logs.append(line.decode(errors="replace").rstrip())

    relaying = asyncio.create_task(relay())
    address = f"127.0.0.1:{port}"
    try:
        await wait_for_health(address, 120)  # gRPC health through Envoy reaches the gateway
        assert await asyncio.to_thread(cli.main, ["health", address]) == 0  # the healthcheck command

        async with grpc.aio.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=4))
            frames = [f async for f in stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")])]
        assert "".join(f.text for f in frames) == "".join(WORDS)

        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession() as http, http.get(f"http://{address}/v1/models", headers=headers) as r:
            assert r.status == 200
            assert [m["id"] for m in (await r.json())["data"]] == ["fake-model"]

        assert any('"frontdoor_started"' in line and f"127.0.0.1:{gateway_port}" in line for line in logs)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 60)
        await relaying
    assert code == 0, "\n".join(logs[-20:])
    assert not any("Traceback" in line for line in logs), "\n".join(logs)
    with pytest.raises(OSError):  # Envoy (a child) is gone with it
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
