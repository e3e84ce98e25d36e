"""``meshserve up``'s supervision under load: ``kill -9`` of each kind of service in turn (edge
worker, cloud worker, cache service, gateway with its embedded router, the cache Redis, the state
Redis) in a mesh started as ``meshserve up`` starts it (``MeshConfig(supervise=True)``, the default
layout, its own two Redis).

Each kill lands while greedy streams run. The edge kill is the issue's scenario: 8 streams fill both
edge replicas' slots, so the streams of the killed one must wait for a slot of the other (the same
INT4 build) instead of continuing on the cloud tier's fp32 weights; the wait is bounded by
``resume_same_build_wait_s``, set generously here so a slow machine does not turn it into a crossing
(while it waits, the killed replica itself may come back and take them: the same build too).

Every service must come back by itself within ``BACK_WITHIN_S`` (its supervisor record shows the
restart and the exit reason, and it serves again), and no request may be lost beyond those in flight
on the killed process: streams on a killed worker resume; streams on a killed edge worker resume on
an edge replica (the same build) and equal the undisturbed run, with ``route.reason`` ``failover``;
streams on the killed cloud worker, whose build has no other replica, resume on the edge tier and say
``failover_cross_build``; a killed gateway ends its own streams with UNAVAILABLE and nothing else; the
cache service and Redis are not on the request path of a stream (the rate limiter fails open), so
every stream ends whole. A batch running while the state Redis is killed goes on once its supervisor
has it back (it replays its append-only file): one result per input line, none lost, none twice.

Kept short for CI (2 cores): one mesh, 4 streams of 24 tokens per kill (8 of 64 for the edge kill).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from rich.console import Console

from services.cli.status import MeshView, gather, redis_roles, render
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as admin_pb
from services.common.pb.meshserve.internal.v1 import router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import batch_pb2 as bpb
from services.common.pb.meshserve.v1 import batch_pb2_grpc, inference_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.local.mesh import STATE_REDIS, Mesh, MeshConfig
from tests.fault.conftest import (
    PROMPTS,
    ROUTER_ENV,
    STREAM_BOUND_S,
    Stream,
    _sink,
    assert_equal_to_reference,
    auth,
    finish,
    reference,
    run_load,
    stats,
)

pytestmark = pytest.mark.fault

BACK_WITHIN_S = float(os.environ.get("MESHSERVE_FAULT_BACK_WITHIN_S", "90"))
# Liveness, not speed: the 10 s target is a timing, which tests do not assert (the times are
# printed at the end of the module; `python -m benchmarks.mesh.restart` measures them the same way and
# judges the target: docs/benchmarks/restart.md).
"""The issue's bound; a machine shared with other work (load average several times its cores) may
need more, given here."""
BACK_S: dict[str, float] = {}
"""Seconds each killed service took to serve again (printed at the end of the module)."""
STREAMS = 4
MAX_TOKENS = 24
EDGE_MAX_TOKENS = 64
"""The edge kill's streams are longer: with 24 tokens a replica could end all its streams between the
moment it was seen busy and the kill on a loaded 2-core machine, and nothing was left to fail over."""
ADMIN = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)


@pytest.fixture(scope="module")
async def up_mesh() -> AsyncIterator[Mesh]:
    env = {**ROUTER_ENV, "MESHSERVE_ROUTER_RESUME_SAME_BUILD_WAIT_S": "60"}
    config = MeshConfig(
        edge_workers=2,
        cloud_workers=1,
        extra_env=env,
        supervise=True,
    )
    async with Mesh(config, sink=_sink) as running:
        yield running


@pytest.fixture(scope="module", autouse=True)
def _report_back_times() -> Iterator[None]:
    yield
    print(f"\nback within (s): {', '.join(f'{k} {v:.1f}' for k, v in BACK_S.items())}")


@pytest.fixture(scope="module")
async def up_stub(up_mesh: Mesh) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(up_mesh.gateway_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def kill_9_and_wait_back(mesh: Mesh, name: str) -> float:
    """``kill -9`` of service ``name``; the seconds until its supervisor has it serving again."""
    assert mesh.supervisor is not None
    record = mesh.supervisor.records[name]
    restarts = record.restarts
    proc = mesh.redis_processes.get(name) or mesh.processes[name]
    began = time.monotonic()
    await proc.kill()
    while not (record.restarts > restarts and record.state == "running"):
        assert time.monotonic() - began < BACK_WITHIN_S, f"{name} not back within {BACK_WITHIN_S:.0f} s: {record}"
        await asyncio.sleep(0.05)  # the supervisor's record: no event to wait on from here
    assert record.last_exit == "killed by SIGKILL"
    BACK_S[name] = time.monotonic() - began
    return BACK_S[name]


async def _router_sees_the_edge_idle(mesh: Mesh, bound_s: float = 30) -> None:
    """Until the router's load for every edge replica is 0: right after a load, the replicas' last
    reports may still count its streams, and the router would then send some of the next load to
    the cloud tier as saturated spill (``spill_saturated``), not to the edge slots the test fills."""
    deadline = time.monotonic() + bound_s
    async with grpc.aio.insecure_channel(mesh.router_address) as channel:
        admin = router_admin_pb2_grpc.RouterAdminStub(channel)
        while True:
            reply = await admin.ListReplicas(admin_pb.ListReplicasRequest(), metadata=ADMIN, timeout=5)
            loads = {r.worker_id: r.load for r in reply.replicas if r.tier == pb.TIER_EDGE}
            if len(loads) == 2 and not any(loads.values()):
                return
            assert time.monotonic() < deadline, f"the router still counts load on the edge tier: {loads}"
            await asyncio.sleep(0.05)  # load reports arrive by heartbeat: no event to wait on


async def _edge_to_kill(mesh: Mesh, streams: list[Stream]) -> str:
    """The busiest edge replica at the first moment every stream has a token and holds a slot.

    Waiting for every stream to be several tokens in left a race: a replica that admitted its
    streams early could finish them all before the last stream of the other started, and the kill
    then hit an idle worker. While every stream holds a slot, none has ended."""
    deadline = time.monotonic() + 60
    while True:
        loads = {w.name: (await stats(w)).active_sequences for w in mesh.workers("edge")}
        started = all(s.started.is_set() for s in streams)
        ended = any(s.final is not None or s.error is not None for s in streams)
        if (started and sum(loads.values()) >= len(streams)) or ended or time.monotonic() > deadline:
            victim = max(loads, key=lambda name: loads[name])
            assert loads[victim] > 0, f"no edge replica was busy when the kill was due: {loads}"
            return victim
        await asyncio.sleep(0.01)


async def test_a_killed_edge_worker_comes_back_and_its_streams_resume_on_the_same_build(
    up_stub: inference_pb2_grpc.InferenceStub, up_mesh: Mesh
) -> None:
    prompts = PROMPTS[: 2 * STREAMS]  # every slot of both edge replicas (4 each)
    expected = await reference(up_stub, prompts, EDGE_MAX_TOKENS)
    edges = {(await stats(w)).build for w in up_mesh.workers("edge")}
    cloud = {(await stats(w)).build for w in up_mesh.workers("cloud")}
    assert len(edges) == 1 and "" not in edges and not edges & cloud, (edges, cloud)
    await _router_sees_the_edge_idle(up_mesh)
    streams, done = await run_load(up_stub, prompts, EDGE_MAX_TOKENS, started_after=1)
    victim = await _edge_to_kill(up_mesh, streams)
    await kill_9_and_wait_back(up_mesh, victim)
    await finish(done)
    reasons = [s.final.route.reason for s in streams if s.final is not None]
    assert "spill_saturated" not in reasons, reasons  # every stream started on an edge slot
    assert_equal_to_reference(streams, expected)  # resumed on an INT4 replica: the same text
    assert "failover_cross_build" not in reasons and "failover" in reasons, reasons
    assert all(s.final is not None and s.final.route.tier == pb.TIER_EDGE for s in streams)


def _cloud_greedy(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        routing=pb.RoutingOptions(tier=pb.TIER_CLOUD, cache_policy=pb.CACHE_POLICY_BYPASS),
    )


async def test_a_killed_cloud_worker_comes_back_and_its_streams_resume_across_builds(
    up_stub: inference_pb2_grpc.InferenceStub, up_mesh: Mesh
) -> None:
    streams = [Stream(p) for p in PROMPTS[:2]]
    first_tokens = [asyncio.Event() for _ in streams]

    async def consume(stream: Stream, started: asyncio.Event) -> None:
        call = up_stub.Generate(_cloud_greedy(stream.prompt), metadata=auth(), timeout=STREAM_BOUND_S)
        async for frame in call:
            stream.sequences.append(frame.sequence)
            stream.tokens.extend(frame.token_ids)
            if frame.HasField("final"):
                stream.final = frame.final
            if stream.tokens:
                started.set()

    load = asyncio.gather(*(consume(s, e) for s, e in zip(streams, first_tokens, strict=True)))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_tokens)), 60)
    await kill_9_and_wait_back(up_mesh, "cloud-0")
    await asyncio.wait_for(load, STREAM_BOUND_S)
    for stream in streams:
        stream.assert_whole()
        assert stream.final is not None and stream.final.route.reason == "failover_cross_build"
    # Back in routing: once it has registered again, a cloud-hinted request is served by it.
    await _registered(up_mesh, 3)
    final = [f async for f in up_stub.Generate(_cloud_greedy("Name a bird."), metadata=auth())][-1].final
    assert final.route.worker_id == "cloud-0" and final.route.reason == "hint", final.route


@pytest.mark.parametrize("name", ["cache", "redis", STATE_REDIS])
async def test_a_killed_cache_service_or_redis_comes_back_and_no_stream_is_lost(
    up_stub: inference_pb2_grpc.InferenceStub, up_mesh: Mesh, name: str
) -> None:
    prompts = PROMPTS[:STREAMS]
    expected = await reference(up_stub, prompts, MAX_TOKENS)
    streams, done = await run_load(up_stub, prompts, MAX_TOKENS, started_after=2)
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 60)
    await kill_9_and_wait_back(up_mesh, name)
    await finish(done)
    assert_equal_to_reference(streams, expected)
    again, done = await run_load(up_stub, prompts, MAX_TOKENS)  # and after it is back
    await finish(done)
    assert_equal_to_reference(again, expected)


BATCH_LINES = 10


async def test_a_batch_survives_a_kill_9_of_the_state_redis(up_mesh: Mesh) -> None:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"Name a colour ({i}).", "max_tokens": 8, "temperature": 0},
        }
        for i in range(BATCH_LINES)
    ]
    content = "\n".join(json.dumps(x) for x in lines).encode()
    async with grpc.aio.insecure_channel(up_mesh.gateway_address) as channel:
        stub = batch_pb2_grpc.BatchesStub(channel)
        upload = await stub.CreateFile(
            bpb.CreateFileRequest(filename="in.jsonl", purpose="batch", content=content), metadata=auth()
        )
        batch = await stub.CreateBatch(
            bpb.CreateBatchRequest(input_file_id=upload.id, endpoint="/v1/completions", completion_window="1h"),
            metadata=auth(),
        )
        deadline = time.monotonic() + 240
        while (await stub.GetBatch(bpb.BatchRef(batch_id=batch.id), metadata=auth())).request_counts.completed < 2:
            assert time.monotonic() < deadline, "the batch made no progress"
            await asyncio.sleep(0.1)
        await kill_9_and_wait_back(up_mesh, STATE_REDIS)
        while True:  # the gateway's pool reconnects on the next call
            try:
                done = await stub.GetBatch(bpb.BatchRef(batch_id=batch.id), metadata=auth(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                done = None
            if done is not None and done.status in ("completed", "failed", "expired", "cancelled"):
                break
            assert time.monotonic() < deadline, f"batch not done: {done}"
            await asyncio.sleep(0.3)
        assert done.status == "completed", done
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (BATCH_LINES, BATCH_LINES, 0)
        call = stub.GetFileContent(bpb.FileRef(file_id=done.output_file_id), metadata=auth())
        output = [json.loads(x) for x in b"".join([p.content async for p in call]).splitlines()]
        assert sorted(o["custom_id"] for o in output) == sorted(x["custom_id"] for x in lines)


async def test_a_killed_gateway_comes_back_on_its_port_and_loses_only_its_own_streams(
    up_stub: inference_pb2_grpc.InferenceStub, up_mesh: Mesh
) -> None:
    prompts = PROMPTS[:STREAMS]
    expected = await reference(up_stub, prompts, MAX_TOKENS)
    streams, done = await run_load(up_stub, prompts, MAX_TOKENS, started_after=2)
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 60)
    address = up_mesh.gateway_address
    await kill_9_and_wait_back(up_mesh, "gateway")
    await finish(done)
    for stream in streams:  # in flight on the killed process: ended at once, gap-free so far
        assert stream.error == grpc.StatusCode.UNAVAILABLE or stream.final is not None, stream
        assert stream.sequences == list(range(len(stream.sequences)))
    assert up_mesh.gateway_address == address  # the same port: the client's channel reconnects
    await _registered(up_mesh, 3)  # its router learns the workers again from their heartbeats
    again, done = await run_load(up_stub, prompts, MAX_TOKENS)
    await finish(done)
    assert_equal_to_reference(again, expected)


async def _registered(mesh: Mesh, workers: int) -> None:
    began = time.monotonic()
    while True:
        view = await gather(mesh.router_address)
        if sum(r.healthy for r in view.replicas) >= workers:
            return
        assert time.monotonic() - began < BACK_WITHIN_S, f"the workers did not register again: {view.replicas}"
        await asyncio.sleep(0.1)  # heartbeats arrive every second; nothing to wait on from here


def test_status_shows_each_restart_with_its_exit_reason(up_mesh: Mesh) -> None:
    """What `meshserve status` reads from the state file after the kills above."""
    services = up_mesh.describe()["services"]
    assert isinstance(services, dict)
    view = MeshView(router=up_mesh.router_address, services=services, redis=redis_roles(up_mesh.describe()))
    out = io.StringIO()
    Console(file=out, width=200).print(render(view))
    assert f"cache {up_mesh.redis_url}" in out.getvalue()
    assert f"state {up_mesh.state_redis_url} (append-only file in {up_mesh.state_dir})" in out.getvalue()
    killed = [name for name in BACK_S if name in services]
    assert killed, "no kill ran before this test"
    for name in killed:
        row = next(line for line in out.getvalue().splitlines() if line.startswith(f"│ {name} "))
        assert "running" in row and "killed by SIGKILL" in row, row
