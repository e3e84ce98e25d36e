"""Gateways with the router embedded in their process, as real processes, in front of one real worker
runtime over the synthetic engine (benchmarks/gateway/instant_worker.py) and a real redis-server: the layout
``meshserve up``, compose and Kubernetes run. The worker registers with every gateway's router by
heartbeat, as a deployed worker does."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.cli.client import MeshClient, sampling_params
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.processes import ServiceProcess, free_port
from services.local.mesh import DEV_API_KEY, api_key_hash
from tests.helpers import redis_server

INTERNAL = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)


@dataclass
class EmbeddedMesh:
    gateways: list[ServiceProcess]
    router_ports: list[int]
    worker: ServiceProcess
    redis_url: str


async def _start(proc: ServiceProcess) -> ServiceProcess:
    await proc.spawn()
    await proc.wait_started(120)
    return proc


@contextlib.asynccontextmanager
async def embedded_mesh(gateways: int = 1, token_interval_ms: int = 5) -> AsyncIterator[EmbeddedMesh]:
    """``gateways`` gateway processes (each with its router) and one worker registered with all of
    them; yields once every gateway's router lists the worker."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    sink = lambda _name, _line: None  # noqa: E731
    router_ports = [free_port() for _ in range(gateways)]
    with redis_server() as redis, tempfile.TemporaryDirectory(prefix="meshserve-embedded-"):
        started: list[ServiceProcess] = []
        worker: ServiceProcess | None = None
        try:
            for i, port in enumerate(router_ports):
                gateway_env = env | {
                    "MESHSERVE_GATEWAY_EMBED_ROUTER": "1",
                    "MESHSERVE_GATEWAY_API_KEYS": f"dev:{api_key_hash(DEV_API_KEY)}",
                    "MESHSERVE_GATEWAY_REDIS_URL": redis.url,
                    "MESHSERVE_ROUTER_PORT": str(port),
                    "MESHSERVE_ROUTER_REDIS_URL": redis.url,
                }
                name = "gateway" if i == 0 else f"gateway-{i}"
                command = [sys.executable, "-m", "services.gateway"]
                started.append(await _start(ServiceProcess(name, command, gateway_env, sink)))
            worker_env = env | {
                "MESHSERVE_INSTANT_WORKER_WORKER_ID": "instant",
                "MESHSERVE_INSTANT_WORKER_TOKEN_INTERVAL_MS": str(token_interval_ms),
                "MESHSERVE_INSTANT_WORKER_ROUTER_ADDRESS": ",".join(f"127.0.0.1:{p}" for p in router_ports),
                "MESHSERVE_INSTANT_WORKER_HEARTBEAT_INTERVAL_S": "0.2",
            }
            command = [sys.executable, "-m", "benchmarks.gateway.instant_worker"]
            worker = await _start(ServiceProcess("worker", command, worker_env, sink))
            for gateway in started:
                async with MeshClient(gateway.address, DEV_API_KEY) as client:
                    await wait_for_edge(client)
            yield EmbeddedMesh(started, router_ports, worker, redis.url)
        finally:
            if worker is not None:
                await worker.stop()
            for gateway in started:
                await gateway.stop()


async def wait_for_edge(client: MeshClient) -> None:
    """Until the worker's registration has reached the gateway's router (ListModels shows the edge tier)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        reply = await client.stub.ListModels(pb.ListModelsRequest(), metadata=client.metadata, timeout=5)
        if reply.models and pb.TIER_EDGE in reply.models[0].tiers:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("the worker never registered with the embedded router")


def greedy_request(prompt: str, max_tokens: int = 24, model: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt,
        model=model,
        sampling=sampling_params(max_tokens=max_tokens, temperature=0.0),
        routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
    )


async def worker_stats(address: str) -> worker_pb2.WorkerStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), metadata=INTERNAL, timeout=5)


async def worker_idle(address: str) -> worker_pb2.WorkerStats:
    """The worker's stats once no sequence is active (bounded: 5 s); aborted starts end a little late."""
    for _ in range(100):
        stats = await worker_stats(address)
        if stats.active_sequences == 0:
            break
        await asyncio.sleep(0.05)
    return stats
