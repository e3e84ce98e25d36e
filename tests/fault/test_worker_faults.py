"""Worker faults under a bounded load of concurrent greedy streams: ``kill -9``, a slowed worker, a
stalled (SIGSTOPped) worker. Each test asserts that every stream ends within a bound, ends OK with
frames numbered without gap or duplicate, and produces exactly the tokens and text of the undisturbed
run; then that the mesh recovers (the worker is back and takes traffic).

The single-stream kill -9 with its resume invariant is tests/e2e/test_router_failover.py; the
stall with fake workers is tests/integration/router/test_router_resilience.py. These run several
streams on the real edge workers at once, so a fault hits streams at different points.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from services.local.mesh import Mesh
from tests.fault.conftest import (
    FULL,
    PROMPTS,
    STREAMS,
    assert_equal_to_reference,
    finish,
    reference,
    restart,
    run_load,
    served_by,
    stats,
)

pytestmark = pytest.mark.fault


async def _busiest_edge(mesh: Mesh) -> str:
    loads = {w.name: (await stats(w)).active_sequences for w in mesh.workers("edge")}
    return max(loads, key=lambda name: loads[name])


@pytest.mark.parametrize("round_", range(2 if FULL else 1))
async def test_kill_9_of_a_worker_mid_stream_under_load(fault_stub, fault_mesh: Mesh, round_: int) -> None:
    prompts = PROMPTS[:STREAMS]
    expected = await reference(fault_stub, prompts)
    streams, done = await run_load(fault_stub, prompts)
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 60)
    victim = await _busiest_edge(fault_mesh)
    await fault_mesh.processes[victim].kill()  # SIGKILL: no drain, streams break mid-generation
    try:
        await finish(done)
        assert_equal_to_reference(streams, expected)
        moved = [s for s in streams if s.final is not None and s.final.route.reason == "failover"]
        assert moved, f"no stream was on {victim}; the kill proved nothing"
        assert all(s.final is not None and s.final.route.worker_id != victim for s in streams)
    finally:  # the next tests need both workers, whatever happened here
        await restart(fault_mesh, victim, "MESHSERVE_EDGE_WORKER_PORT")
    await served_by(fault_stub, victim)  # recovery: the router routes to the restarted worker again


async def test_slow_worker_streams_stay_whole(fault_stub, fault_mesh: Mesh) -> None:
    """Once the streams run, the busiest worker gets ~40 % of the CPU time it asks for (stopped 60 ms
    of every 100 ms): its streams slow down but must stay whole and correct; nothing fails or hangs."""
    prompts = PROMPTS[:STREAMS]
    expected = await reference(fault_stub, prompts)
    streams, done = await run_load(fault_stub, prompts, started_after=2)
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 60)
    slow = fault_mesh.processes[await _busiest_edge(fault_mesh)]
    try:
        while not done.done():
            slow.signal(signal.SIGSTOP)
            await asyncio.wait({done}, timeout=0.06)
            slow.signal(signal.SIGCONT)
            await asyncio.wait({done}, timeout=0.04)
    finally:
        slow.signal(signal.SIGCONT)
    await finish(done)
    assert_equal_to_reference(streams, expected)
    touched = [s for s in streams if s.final is not None and slow.name in (s.final.route.worker_id, "")]
    assert touched or any(s.final is not None and s.final.route.reason == "failover" for s in streams)
    await served_by(fault_stub, slow.name)


async def test_stalled_worker_is_failed_over_and_comes_back(fault_stub, fault_mesh: Mesh) -> None:
    """SIGSTOP the busiest worker mid-stream: its streams must resume elsewhere after the router's
    stall timeout (not hang), with the undisturbed tokens; after SIGCONT the worker serves again."""
    prompts = PROMPTS[:STREAMS]
    expected = await reference(fault_stub, prompts)
    streams, done = await run_load(fault_stub, prompts)
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 60)
    victim = fault_mesh.processes[await _busiest_edge(fault_mesh)]
    victim.signal(signal.SIGSTOP)
    try:
        await finish(done)
    finally:
        victim.signal(signal.SIGCONT)

    assert_equal_to_reference(streams, expected)
    moved = [s for s in streams if s.final is not None and s.final.route.reason == "failover"]
    assert moved, f"no stream was on {victim.name}"
    # SIGCONT comes only after every stream ended: a stream that waited for the worker would hang.
    assert all(s.final is not None and s.final.route.worker_id != victim.name for s in moved)
    await victim.wait_serving(60)
    await served_by(fault_stub, victim.name)
