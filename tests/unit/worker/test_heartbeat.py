"""Worker self-registration: heartbeats to a recording WorkerRegistry on a real gRPC server (port 0)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from services.common.config import ServiceSettings, load_settings
from services.common.pb.meshserve.internal.v1 import registry_pb2, registry_pb2_grpc, worker_pb2
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.serving import RunningServer, start_server
from services.worker.config import WorkerSettings
from services.worker.heartbeat import Heartbeater
from services.worker.server import start_worker
from tests.unit.worker.fakes import FakeEngine, SleepyEngine

TOKEN = "hb-token"


@dataclass
class Recorder(registry_pb2_grpc.WorkerRegistryServicer):
    """Records heartbeats; answers with ``ttl_ms``."""

    ttl_ms: int = 300
    beats: list[registry_pb2.WorkerHeartbeat] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def Heartbeat(
        self, request: registry_pb2.WorkerHeartbeat, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatReply:
        self.beats.append(request)
        self.arrived.set()
        return registry_pb2.HeartbeatReply(ttl_ms=self.ttl_ms)

    async def wait_for(self, n: int, timeout_s: float = 10.0) -> None:
        async def loop() -> None:
            while len(self.beats) < n:
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(loop(), timeout_s)


async def start_registry(recorder: Recorder, port: int = 0) -> RunningServer:
    settings = load_settings(ServiceSettings, port=port, internal_token=TOKEN, shutdown_grace_s=0)
    name = registry_pb2.DESCRIPTOR.services_by_name["WorkerRegistry"].full_name
    return await start_server(
        settings, lambda s: registry_pb2_grpc.add_WorkerRegistryServicer_to_server(recorder, s), [name], internal=True
    )


@pytest.fixture
async def registry() -> AsyncIterator[tuple[Recorder, RunningServer]]:
    recorder = Recorder()
    server = await start_registry(recorder)
    yield recorder, server
    await server.stop()


async def test_worker_registers_keeps_beating_with_its_load_and_says_goodbye(
    registry: tuple[Recorder, RunningServer],
) -> None:
    recorder, server = registry
    settings = load_settings(
        WorkerSettings,
        port=0,
        worker_id="w-7",
        internal_token=TOKEN,
        router_address=f"127.0.0.1:{server.port}",
        heartbeat_interval_s=5.0,  # the router's TTL (300 ms) shortens it to 100 ms
        shutdown_grace_s=0,
    )
    worker = await start_worker(settings, FakeEngine(), tier="cloud")
    try:
        await recorder.wait_for(3)  # only possible this fast because the TTL shortened the period
        first = recorder.beats[0]
        assert first.address == f"127.0.0.1:{worker.port}" and first.tier == pb.TIER_CLOUD
        assert first.stats.worker_id == "w-7" and first.stats.max_active_sequences == 4
        assert not first.leaving
        assert worker.heartbeater is not None and worker.heartbeater.registered == {f"127.0.0.1:{server.port}": True}
    finally:
        await worker.stop()
    assert recorder.beats[-1].leaving  # graceful stop says goodbye
    assert recorder.beats[-1].address == first.address


async def test_a_model_state_change_is_heartbeated_at_once(registry: tuple[Recorder, RunningServer]) -> None:
    recorder, server = registry
    recorder.ttl_ms = 600_000  # the period stays 60 s: only a state change can send the next beats
    settings = load_settings(
        WorkerSettings,
        port=0,
        internal_token=TOKEN,
        router_address=f"127.0.0.1:{server.port}",
        heartbeat_interval_s=60.0,
        shutdown_grace_s=0,
    )
    worker = await start_worker(settings, SleepyEngine(), tier="edge")
    try:
        await recorder.wait_for(1)
        assert recorder.beats[0].stats.model_state == worker_pb2.MODEL_STATE_AWAKE
        assert recorder.beats[0].stats.resident_bytes > 0
        await worker.runner.model.sleep()
        await recorder.wait_for(2)
        while recorder.beats[-1].stats.model_state != worker_pb2.MODEL_STATE_ASLEEP:
            await recorder.wait_for(len(recorder.beats) + 1)
        await worker.runner.model.wake()
        while recorder.beats[-1].stats.model_state != worker_pb2.MODEL_STATE_AWAKE:
            await recorder.wait_for(len(recorder.beats) + 1)
    finally:
        await worker.stop()


async def test_heartbeats_need_the_internal_credential(registry: tuple[Recorder, RunningServer]) -> None:
    recorder, server = registry
    hb = Heartbeater(
        [f"127.0.0.1:{server.port}"],
        address="127.0.0.1:1",
        tier=pb.TIER_EDGE,
        stats=_stats,
        internal_token="wrong",
        interval_s=0.01,
        max_backoff_s=0.02,
    )
    hb.start()
    try:
        await asyncio.wait_for(hb.wait_state(f"127.0.0.1:{server.port}", False), 10)  # refused: bad credential
        assert hb.registered == {f"127.0.0.1:{server.port}": False} and recorder.beats == []
    finally:
        await hb.stop()
        await hb.close()


async def test_an_unreachable_router_is_retried_with_backoff_until_it_comes_up() -> None:
    from services.common.processes import free_port

    port = free_port()
    recorder = Recorder()
    hb = Heartbeater(
        [f"127.0.0.1:{port}"],
        address="127.0.0.1:1",
        tier=pb.TIER_EDGE,
        stats=_stats,
        internal_token=TOKEN,
        interval_s=0.02,
        timeout_s=0.5,
        max_backoff_s=0.1,
    )
    hb.start()
    server = None
    try:
        await asyncio.wait_for(hb.wait_state(f"127.0.0.1:{port}", False), 10)
        server = await start_registry(recorder, port)
        await asyncio.wait_for(hb.wait_state(f"127.0.0.1:{port}", True), 10)
        assert recorder.beats and hb.beats[f"127.0.0.1:{port}"] >= 1
    finally:
        await hb.leave()
        await hb.close()
        if server is not None:
            await server.stop()
    assert recorder.beats[-1].leaving


async def _stats() -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(worker_id="w")


async def test_resolved_routers_are_all_heartbeated_and_followed_as_they_change() -> None:
    """With ``resolve`` the worker beats to every address the name lists now (a headless Service)."""
    recorders = [Recorder(), Recorder(), Recorder()]
    servers = [await start_registry(r) for r in recorders]
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    listed = {"routers.test:1": addresses[:2]}

    async def resolver(name: str) -> list[str]:
        return listed[name]

    hb = Heartbeater(
        ["routers.test:1"],
        address="127.0.0.1:1",
        tier=pb.TIER_EDGE,
        stats=_stats,
        internal_token=TOKEN,
        interval_s=0.02,
        resolve=True,
        resolver=resolver,
    )
    hb.start()
    try:
        await asyncio.wait_for(hb.wait_routers(2), 10)
        assert hb.routers == sorted(addresses[:2]) and recorders[0].beats and recorders[1].beats
        listed["routers.test:1"] = addresses[1:]  # one replica gone, another scaled up
        await asyncio.wait_for(hb.wait_state(addresses[2], True), 10)
        assert hb.routers == sorted(addresses[1:])
        seen_by_gone = len(recorders[0].beats)
        await recorders[2].wait_for(len(recorders[2].beats) + 3)  # several rounds later...
        assert len(recorders[0].beats) == seen_by_gone  # ...the vanished address gets nothing more
    finally:
        await hb.leave()
        await hb.close()
        for server in servers:
            await server.stop()
    assert recorders[1].beats[-1].leaving and recorders[2].beats[-1].leaving and not recorders[0].beats[-1].leaving


async def test_a_failed_resolution_keeps_the_last_known_routers() -> None:
    recorder = Recorder()
    server = await start_registry(recorder)
    answers: list[list[str] | None] = [[f"127.0.0.1:{server.port}"]]

    async def resolver(name: str) -> list[str]:
        if answers[-1] is None:
            raise OSError("Name or service not known")
        return answers[-1]

    hb = Heartbeater(
        ["routers.test:1"], address="127.0.0.1:1", tier=pb.TIER_EDGE, stats=_stats, internal_token=TOKEN,
        interval_s=0.02, resolve=True, resolver=resolver,
    )  # fmt: skip
    hb.start()
    try:
        await asyncio.wait_for(hb.wait_routers(1), 10)
        answers.append(None)  # DNS hiccup: keep beating to what we know
        await recorder.wait_for(len(recorder.beats) + 3)
        assert hb.routers == [f"127.0.0.1:{server.port}"] and hb.registered[f"127.0.0.1:{server.port}"]
    finally:
        await hb.leave()
        await hb.close()
        await server.stop()


async def test_real_dns_resolution_of_a_router_name(registry: tuple[Recorder, RunningServer]) -> None:
    """The default resolver goes through getaddrinfo: ``localhost`` names the recorder on 127.0.0.1."""
    recorder, server = registry
    hb = Heartbeater(
        [f"localhost:{server.port}"], address="127.0.0.1:1", tier=pb.TIER_EDGE, stats=_stats,
        internal_token=TOKEN, interval_s=0.02, resolve=True,
    )  # fmt: skip
    hb.start()
    try:
        await asyncio.wait_for(hb.wait_state(f"127.0.0.1:{server.port}", True), 10)
        assert f"127.0.0.1:{server.port}" in hb.routers
    finally:
        await hb.stop()
        await hb.close()
    assert recorder.beats and recorder.beats[0].address == "127.0.0.1:1"
