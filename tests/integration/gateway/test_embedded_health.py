"""A gateway that carries the router reports the router's health on its public port: SERVING only
while a worker replica is healthy, so a load balancer sends no calls to a gateway that could only
refuse them (one restarted before its workers' next heartbeats); NOT_SERVING again once the last
worker has left. Real processes: the gateway(+router), the worker runtime over the synthetic engine
(benchmarks/gateway/instant_worker.py) registering by heartbeat, Redis."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.processes import ServiceProcess, free_port
from services.local.mesh import DEV_API_KEY, api_key_hash
from tests.helpers import redis_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


async def _until(address: str, status: int, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            if (now := await _health(address)) == status:
                return
        except grpc.aio.AioRpcError as exc:  # not listening yet
            now = exc.code().value[0]
        assert time.monotonic() < deadline, f"health stayed {now}, wanted {status}"
        await asyncio.sleep(0.05)  # polling Health.Check (Watch would hide a status it skips)


async def test_the_gateways_health_is_its_routers() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    sink = lambda _name, _line: None  # noqa: E731
    router_port = free_port()
    with redis_server() as redis:
        gateway_env = env | {
            "MESHSERVE_GATEWAY_EMBED_ROUTER": "1",
            "MESHSERVE_GATEWAY_API_KEYS": f"dev:{api_key_hash(DEV_API_KEY)}",
            "MESHSERVE_GATEWAY_REDIS_URL": redis.url,
            "MESHSERVE_ROUTER_PORT": str(router_port),
            "MESHSERVE_ROUTER_REDIS_URL": redis.url,
        }
        gateway = ServiceProcess("gateway", [sys.executable, "-m", "services.gateway"], gateway_env, sink)
        await gateway.spawn()
        try:
            await gateway.wait_started(120)
            await _until(f"127.0.0.1:{router_port}", NOT_SERVING)  # the router is up and knows no worker
            assert await _health(gateway.address) == NOT_SERVING
            worker_env = env | {
                "MESHSERVE_INSTANT_WORKER_WORKER_ID": "instant",
                "MESHSERVE_INSTANT_WORKER_ROUTER_ADDRESS": f"127.0.0.1:{router_port}",
                "MESHSERVE_INSTANT_WORKER_HEARTBEAT_INTERVAL_S": "0.2",
            }
            worker = ServiceProcess(
                "worker", [sys.executable, "-m", "benchmarks.gateway.instant_worker"], worker_env, sink
            )
            await worker.spawn()
            try:
                await worker.wait_started(120)
                await _until(gateway.address, SERVING)  # the worker registered by heartbeat
            finally:
                await worker.stop()  # it tells the router it leaves
            await _until(gateway.address, NOT_SERVING)
        finally:
            await gateway.stop()
