"""A server that is stopping stays NOT_SERVING, whatever asks for SERVING meanwhile (a router's worker
registering while its gateway drains, say): a load balancer must not send it new calls."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ServiceSettings
from services.common.serving import start_server


async def _status(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


async def test_a_stopping_server_ignores_requests_to_serve() -> None:
    settings = ServiceSettings(host="127.0.0.1", port=0, metrics_port=-1, shutdown_grace_s=2.0)
    running = await start_server(settings, register=lambda _server: None, service_names=[])
    assert await _status(running.port) == health_pb2.HealthCheckResponse.SERVING
    held = asyncio.Event()

    async def hook() -> None:  # a stop hook: runs after the drain, while the server is stopping
        await running.set_serving(True)
        held.set()

    running.on_stop.append(hook)
    await running.stop()
    await running.set_serving(True)  # after the stop too
    assert running.stopping and held.is_set()
    reply = await running.health.Check(health_pb2.HealthCheckRequest(), None)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
