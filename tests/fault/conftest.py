"""A real mesh to break: its own redis-server (stopped and restarted by the tests), 2 edge workers,
router, cache, gateway — the launcher of ``meshserve up`` (:class:`services.local.mesh.Mesh`).

Router settings that make faults show up in seconds rather than minutes: a worker silent for
``STALL_TIMEOUT_S`` is treated as failed (default 30 s), ejections last at most 2 s and a re-admitted
replica takes its full share at once, so a test can watch the mesh recover. Everything else is the
default configuration (rate limiter fail-open, tenant limits on).

Short by default (part of ``make test``); ``MESHSERVE_FAULT_FULL=1`` (``make fault``) runs more
streams, more rounds and the extra variants.

Helpers shared by the fault tests: a bounded load of greedy streams recorded frame by frame, the
undisturbed reference run of that load, and restarting a killed service on its old port.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import Mesh, MeshConfig, ServiceProcess
from tests.e2e.conftest import auth
from tests.e2e.test_router_failover import STORY, greedy, stats
from tests.helpers import RedisServer, redis_server

FULL = os.environ.get("MESHSERVE_FAULT_FULL") == "1"
STREAMS = 4
"""One worker's slots (``max_active_sequences`` = 4): after a fault the survivor can run every stream at
once, which keeps the CI run short. (Streams beyond its slots wait in its queue; its queued keepalives
keep the router's stall timer from ejecting it, see docs/testing.md.)"""
MAX_TOKENS = 64 if FULL else 32
STALL_TIMEOUT_S = 10.0
"""Shorter than the default 30 s so the stall test is quick, but longer than a loaded 2-core
machine's time to a resumed stream's first frame (prefill + replay of the sent tokens behind the
worker's own streams): at 3 s the router declared the surviving worker stalled after a kill -9 and
ejected it, failing every stream with UNAVAILABLE."""
STREAM_BOUND_S = 90.0
"""No stream of a fault test may take longer than this (a hung stream fails the test)."""

PROMPTS = [f"{STORY} Chapter {i}." for i in range(8)]

__all__ = ["FULL", "MAX_TOKENS", "STREAMS", "Stream", "auth", "greedy", "run_load", "stats"]


def _sink(name: str, line: str) -> None:
    # Warnings too: they say why a stream failed over or was refused (shown when a test fails).
    if '"level": "error"' in line or '"level": "warning"' in line or "Traceback" in line:
        sys.stderr.write(f"{name} | {line}\n")


@pytest.fixture(scope="package")
def fault_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


ROUTER_ENV = {
    "MESHSERVE_ROUTER_STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
    "MESHSERVE_ROUTER_EJECT_MAX_S": "2",
    "MESHSERVE_ROUTER_READMIT_S": "0",
    "MESHSERVE_ROUTER_HEALTH_TIMEOUT_S": "1",
    # The batch runner (test_batch_faults.py): a dead runner's lines are taken over after 3 s, not 30.
    "MESHSERVE_BATCH_CLAIM_IDLE_S": "3",
}


@pytest.fixture(scope="package")
async def fault_mesh(fault_redis: RedisServer) -> AsyncIterator[Mesh]:
    # The split layout: these tests kill and restart the router and the gateway one at a time
    # (test_embedded_gateway_faults.py breaks the default layout, the router inside the gateway).
    config = MeshConfig(
        edge_workers=2, cloud_workers=0, redis_url=fault_redis.url, extra_env=ROUTER_ENV, embed_router=False
    )
    async with Mesh(config, sink=_sink) as running:
        yield running


@pytest.fixture(scope="package")
async def fault_stub(fault_mesh: Mesh) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(fault_mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


@dataclass
class Stream:
    """What one client saw of one Generate stream."""

    prompt: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sequences: list[int] = field(default_factory=list)
    final: pb.Final | None = None
    error: grpc.StatusCode | None = None
    details: str = ""
    seconds: float = 0.0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the stream has at least ``started_after`` tokens."""

    def assert_whole(self) -> None:
        """Ended OK, frames numbered 0..n-1 without gap, one final frame, usage covers the tokens."""
        assert self.error is None, f"{self.prompt[-12:]!r} failed: {self.error} {self.details}"
        assert self.sequences == list(range(len(self.sequences))), f"gap or duplicate: {self.sequences}"
        assert self.final is not None, "the stream ended without a final frame"
        assert self.final.usage.completion_tokens >= len(self.tokens)


async def _consume(stub: inference_pb2_grpc.InferenceStub, stream: Stream, max_tokens: int, started_after: int) -> None:
    begin = time.monotonic()
    try:
        async for frame in stub.Generate(greedy(stream.prompt, max_tokens), metadata=auth(), timeout=STREAM_BOUND_S):
            assert stream.final is None, "a frame arrived after the final frame"
            stream.sequences.append(frame.sequence)
            stream.tokens.extend(frame.token_ids)
            stream.text += frame.text
            if frame.HasField("final"):
                stream.final = frame.final
            if len(stream.tokens) >= started_after:
                stream.started.set()
    except grpc.aio.AioRpcError as exc:
        stream.error, stream.details = exc.code(), exc.details() or ""
    finally:
        stream.seconds = time.monotonic() - begin
        stream.started.set()


async def run_load(
    stub: inference_pb2_grpc.InferenceStub,
    prompts: list[str],
    max_tokens: int = MAX_TOKENS,
    started_after: int = 8,
) -> tuple[list[Stream], asyncio.Future[list[None]]]:
    """Start one greedy stream per prompt; returns the streams (filled as frames arrive) and a future
    that completes when all have ended. Await ``asyncio.gather(*(s.started.wait() ...))`` to inject a
    fault once every stream is mid-generation."""
    streams = [Stream(p) for p in prompts]
    done = asyncio.gather(*(_consume(stub, s, max_tokens, started_after) for s in streams))
    return streams, done


async def finish(done: asyncio.Future[list[None]]) -> None:
    """Wait for a load to end; a stream still open after the bound is a hung stream."""
    try:
        await asyncio.wait_for(asyncio.shield(done), STREAM_BOUND_S + 10)
    except TimeoutError:
        done.cancel()
        raise AssertionError(f"a stream did not end within {STREAM_BOUND_S + 10:.0f} s") from None


_REFERENCE: dict[tuple[str, int], tuple[list[int], str]] = {}


async def reference(
    stub: inference_pb2_grpc.InferenceStub, prompts: list[str], max_tokens: int = MAX_TOKENS
) -> list[tuple[list[int], str]]:
    """The undisturbed greedy output of each prompt under the same concurrency (computed once)."""
    missing = [p for p in prompts if (p, max_tokens) not in _REFERENCE]
    if missing:
        streams, done = await run_load(stub, missing, max_tokens)
        await finish(done)
        for s in streams:
            s.assert_whole()
            _REFERENCE[(s.prompt, max_tokens)] = (s.tokens, s.text)
    return [_REFERENCE[(p, max_tokens)] for p in prompts]


def assert_equal_to_reference(streams: list[Stream], expected: list[tuple[list[int], str]]) -> None:
    for stream, (tokens, text) in zip(streams, expected, strict=True):
        stream.assert_whole()
        assert stream.tokens == tokens, f"{stream.prompt[-12:]!r}: tokens differ from the undisturbed run"
        assert stream.text == text


async def restart(mesh: Mesh, name: str, port_env: str) -> ServiceProcess:
    """Start service ``name`` again on its old port (after a kill or stop) and wait until SERVING."""
    old = mesh.processes[name]
    env = {**old.env, port_env: str(old.port)}
    proc = ServiceProcess(name, old.argv, env, old.sink)
    await proc.spawn()
    await proc.wait_started(120)
    await proc.wait_serving(120)
    mesh.processes[name] = proc
    return proc


async def served_by(stub: inference_pb2_grpc.InferenceStub, worker_id: str, attempts: int = 150) -> int:
    """Send short requests until one is served by ``worker_id`` (the router took it back); returns
    how many it took. Fails after ``attempts``."""
    for i in range(attempts):
        req = greedy(f"Say a word about the number {i} ({worker_id}).", 2)
        frames = [f async for f in stub.Generate(req, metadata=auth(), timeout=STREAM_BOUND_S)]
        if frames[-1].final.route.worker_id == worker_id:
            return i + 1
    raise AssertionError(f"{worker_id} got no traffic again after {attempts} requests")


async def active_sequences(mesh: Mesh) -> int:
    return sum([(await stats(w)).active_sequences for w in mesh.workers("edge")])


async def wait_idle(mesh: Mesh, bound_s: float) -> None:
    """Until no edge worker generates (after a gateway died with streams open), at most ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while await active_sequences(mesh):
        assert time.monotonic() < deadline, f"workers still generating {bound_s:.0f} s after the gateway died"
        await asyncio.sleep(0.1)  # polling worker Stats; there is no event for "idle"


async def gateway_restart_under_load(mesh: Mesh, how: str) -> None:
    """The gateway stopped mid-load (``kill_9`` or ``sigterm``), then restarted on its old ports.

    ``kill_9``: every open stream ends at once with UNAVAILABLE, numbered without a gap so far, and
    the workers stop generating within 30 s. ``sigterm``: in-flight streams drain whole. Either way,
    calls while it is down fail fast with UNAVAILABLE, and after the restart the same client channel
    gets the undisturbed output.
    """
    prompts = PROMPTS[:STREAMS]
    max_tokens = MAX_TOKENS if how == "kill_9" else 24  # a graceful stop drains within its 10 s grace
    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        expected = await reference(stub, prompts, max_tokens)
        streams, done = await run_load(stub, prompts, max_tokens, started_after=2)
        await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 60)
        gateway = mesh.processes["gateway"]
        if how == "kill_9":
            await gateway.kill()
            await finish(done)
            for stream in streams:  # each ends at once, with what it got so far numbered without gap
                assert stream.error == grpc.StatusCode.UNAVAILABLE, (stream.error, stream.details, stream.final)
                assert stream.sequences == list(range(len(stream.sequences)))
            await wait_idle(mesh, 30)
        else:
            await gateway.stop()  # SIGTERM: NOT_SERVING, drain in-flight streams, exit
            await finish(done)
            assert_equal_to_reference(streams, expected)

        with pytest.raises(grpc.aio.AioRpcError) as down:  # while it is down: fail fast, no hang
            await stub.Complete(greedy("Name a colour.", 2), metadata=auth(), timeout=10)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE

        await restart(mesh, "gateway", "MESHSERVE_GATEWAY_PORT")  # its environment keeps its other ports
        streams, done = await run_load(stub, prompts, max_tokens)  # the same channel reconnects
        await finish(done)
        assert_equal_to_reference(streams, expected)
