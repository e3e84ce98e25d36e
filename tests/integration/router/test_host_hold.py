"""The host's foreground flag on real components: a real router and two real edge workers (the real
small model) on one host (127.0.0.1). A background turn (a batch line) on one worker makes no decode
progress while a foreground turn streams on the other, and finishes after it; under a foreground load
that never pauses the line still finishes (the engine's bound); a flag its router never renews, or
whose connection ends, stops holding by itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from services.common import metadata as md
from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import MAX_MESSAGE_BYTES
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.ort_engine import OrtEngine
from services.edge_worker.server import build_engine, start_edge_worker
from services.router.balancer.stream_transport import StreamConnection
from services.router.config import RouterSettings
from services.router.server import start_router_api
from services.worker.server import RunningWorker
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration
TOKEN = "host-hold-token"


@dataclass
class Mesh:
    stub: inference_pb2_grpc.InferenceStub
    workers: list[RunningWorker]
    engines: list[OrtEngine]

    def engine_of(self, worker_id: str) -> OrtEngine:
        return next(e for w, e in zip(self.workers, self.engines, strict=True) if w.servicer.worker_id == worker_id)


@pytest.fixture(scope="module")
async def mesh(redis_srv: RedisServer) -> AsyncIterator[Mesh]:
    workers: list[RunningWorker] = []
    engines: list[OrtEngine] = []
    for name in ("edge-hold-a", "edge-hold-b"):
        settings = load_settings(
            EdgeWorkerSettings,
            port=0,
            threads=1,
            max_active_sequences=4,
            worker_id=name,
            internal_token=TOKEN,
            warmup=False,
            background_max_hold_s=10.0,  # the most allowed: the bound stays out of the first test
        )
        engine = await asyncio.to_thread(build_engine, settings)
        assert isinstance(engine, OrtEngine)
        engines.append(engine)
        workers.append(await start_edge_worker(settings, engine))
    settings = load_settings(
        RouterSettings,
        edge_workers=",".join(f"127.0.0.1:{w.port}" for w in workers),
        redis_url=redis_srv.url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        cache_retry_after_s=0,
        routing_policy="round_robin",  # consecutive turns alternate between the two workers
    )
    server, _api = await start_router_api(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Mesh(inference_pb2_grpc.InferenceStub(channel), workers, engines)
    finally:
        await channel.close()
        await server.stop()
        for worker in workers:
            await worker.stop()


@dataclass
class Turn:
    """One Generate call's frames as they arrived: (time, token count) each; the worker that ran it."""

    arrivals: list[tuple[float, int]]
    worker: str = ""

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.arrivals if start < t < end)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ended(self) -> float:
        return self.arrivals[-1][0]


async def generate(mesh: Mesh, name: str, tokens: int, *, background: bool, turn: Turn | None = None) -> Turn:
    request = pb.GenerateRequest(
        prompt=f"{name}. Once upon a time, a fox",
        sampling=pb.SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0),
        routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS, background=background),
    )
    metadata = ((md.INTERNAL_TOKEN, TOKEN), (md.TENANT, "acme"), (md.REQUEST_ID, name))
    turn = turn or Turn([])
    async for frame in mesh.stub.Generate(request, metadata=metadata, timeout=300):
        turn.arrivals.append((time.monotonic(), len(frame.token_ids)))
        if frame.HasField("final"):
            turn.worker = frame.final.route.worker_id
    return turn


async def until(check: object, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_a_line_on_the_other_worker_makes_no_progress_while_a_foreground_turn_streams(mesh: Mesh) -> None:
    line = Turn([])
    running = asyncio.create_task(generate(mesh, "line-1", 160, background=True, turn=line))
    await until(lambda: line.tokens >= 3, "the line to decode")
    fg = await generate(mesh, "interactive-1", 48, background=False)
    done = await running
    assert fg.worker and done.worker and fg.worker != done.worker  # the same host, not the same worker
    held = mesh.engine_of(done.worker).hold
    first = fg.arrivals[0][0]
    # Between the interactive turn's first frame and its last, the line decodes nothing (a round
    # already running when the flag came may still arrive: at most one token, or one frame).
    assert line.tokens_between(first, fg.ended) <= 2, (line.tokens_between(first, fg.ended), fg.tokens)
    assert fg.tokens == 48
    assert done.ended > fg.ended and done.tokens == 160  # it finished, after the interactive turn
    assert held.holds.get("host", 0) >= 1 and held.held_s > 0


async def test_a_line_under_a_load_that_never_pauses_still_finishes(mesh: Mesh) -> None:
    for engine in mesh.engines:
        engine.hold.max_hold_s = 0.3
    stop = asyncio.Event()

    async def load(name: str) -> int:
        done = 0
        while not stop.is_set():
            await generate(mesh, f"{name}-{done}", 24, background=False)
            done += 1
        return done

    try:
        loads = [asyncio.create_task(load(f"steady-{k}")) for k in range(2)]
        await asyncio.sleep(0.5)  # the load runs: both workers busy with foreground turns
        bounds = sum(e.hold.bound_hits for e in mesh.engines)
        line = await asyncio.wait_for(generate(mesh, "line-2", 12, background=True), 240)
        stop.set()
        turns = sum(await asyncio.gather(*loads))
    finally:
        stop.set()
        for engine in mesh.engines:
            engine.hold.max_hold_s = 10.0
    assert line.tokens == 12
    assert turns >= 2
    assert sum(e.hold.bound_hits for e in mesh.engines) > bounds  # it advanced by the bound, not a pause


async def test_a_flag_not_renewed_expires_and_one_whose_connection_ends_goes_with_it(mesh: Mesh) -> None:
    # A router that sends the flag and then hangs (never renews it, never clears it): the test's own
    # connection to both workers' stream ports, as the router's.
    conns = []
    for worker in mesh.workers:
        assert worker.stream is not None
        conn = StreamConnection(("127.0.0.1", worker.stream.port), TOKEN, MAX_MESSAGE_BYTES)
        await conn.write(worker_pb2.MuxRequest(background_hold=worker_pb2.BackgroundHold(ttl_ms=1500)))
        conns.append(conn)
    sent = time.monotonic()
    line = await generate(mesh, "line-3", 8, background=True)
    assert line.tokens == 8
    assert line.arrivals[0][0] - sent >= 1.0  # held until the flag expired (1.5 s), not for ever

    for conn in conns:  # a flag of a minute, and the connection ends: the hold ends with it
        await conn.write(worker_pb2.MuxRequest(background_hold=worker_pb2.BackgroundHold(ttl_ms=60_000)))
    await asyncio.sleep(0.2)
    for conn in conns:
        conn.cancel()
    sent = time.monotonic()
    line = await asyncio.wait_for(generate(mesh, "line-4", 8, background=True), 30)
    assert line.tokens == 8 and line.ended - sent < 30
