"""The request path holds a request while its version has no awake replica (services/router/balancer/wake.py hooked
into services/router/balancer/core.py): the turn reaches a worker only once one is awake, through the fake worker
transport of test_core_transport."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from services.common.tokenizer import Tokenizer
from services.router.balancer.core import Chunk, Done, Router, Session
from services.router.balancer.registry import ModelState, Replica
from services.router.balancer.wake import Waker
from services.router.config import IdleSpec
from services.store.response_cache import ResponseCache
from tests.unit.router.balancer.test_core_transport import FakeTransport, _request, _router, _run, _unavailable
from tests.unit.router.balancer.test_wake import _until


def _with_waker(router: Router, woken: list[str], gate: asyncio.Event) -> Waker:
    async def wake(replica: Replica, timeout_s: float) -> None:
        woken.append(replica.address)
        await gate.wait()
        replica.report = replace(replica.report, model_state=ModelState.AWAKE)
        waker.notify()

    async def sleep(replica: Replica, timeout_s: float) -> bool:
        return False

    waker = Waker(model="m", version="v1", replicas=router.replicas, wake=wake, sleep=sleep, idle=IdleSpec())
    router.waker = waker
    return waker


def _asleep(router: Router) -> None:
    for r in router.registry.replicas:
        r.report = replace(r.report, model_state=ModelState.ASLEEP)


async def test_a_request_is_held_until_a_replica_wakes_then_served_there(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    transport = FakeTransport({a: [[[1], [2]]] * 3 for a in ("edge-a", "edge-b", "edge-c")})
    router = _router(tokenizer, cache, transport)
    _asleep(router)
    woken: list[str] = []
    gate = asyncio.Event()
    waker = _with_waker(router, woken, gate)

    async def run() -> list[Chunk | Done]:
        return [e async for e in router.run_turn(_request(), Session())]

    turns = [asyncio.create_task(run()) for _ in range(3)]
    await _until(lambda: waker.held == 3)
    assert transport.opened == []  # nothing reaches a worker while it sleeps
    gate.set()
    results = await asyncio.gather(*turns)
    assert len(woken) == 1  # one wake for the three
    for events in results:
        done = events[-1]
        assert isinstance(done, Done) and done.route.worker_id == woken[0]
    assert {s.replica.address for s in transport.opened} == set(woken)  # only the woken one is routed to


async def test_a_chat_already_on_a_replica_is_not_held(tokenizer: Tokenizer, cache: ResponseCache) -> None:
    transport = FakeTransport({"edge-a": [[[1]], [[2]]], "edge-b": [], "edge-c": []})
    router = _router(tokenizer, cache, transport)
    woken: list[str] = []
    _with_waker(router, woken, asyncio.Event())
    session = Session(chat=True)
    request = _request()
    first = [e async for e in router.run_turn(request, session)]
    assert isinstance(first[-1], Done) and session.stream is not None
    _asleep(router)  # the router heard it fall asleep; the worker wakes itself for a turn that reaches it
    session.stream._n = 0  # type: ignore[attr-defined]  # the fake numbers frames per stream; a turn starts at 0
    second = [e async for e in router.run_turn(replace(request, request_id="req-2"), session)]
    assert isinstance(second[-1], Done) and woken == []
    await session.close()


async def test_a_stream_whose_only_awake_worker_dies_is_held_while_another_wakes_then_resumed_there(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    transport = FakeTransport({"edge-a": [[[1], [2], _unavailable()]], "edge-b": [[[3], [4]]], "edge-c": [[[3], [4]]]})
    router = _router(tokenizer, cache, transport)
    for r in router.registry.replicas[1:]:  # edge-a serves; edge-b and edge-c sleep
        r.report = replace(r.report, model_state=ModelState.ASLEEP)
    woken: list[str] = []
    gate = asyncio.Event()
    waker = _with_waker(router, woken, gate)
    turn = asyncio.create_task(_run(router))
    await _until(lambda: waker.held == 1)  # edge-a failed after two tokens: held, not refused
    assert len(transport.opened) == 1
    gate.set()
    events = await turn
    assert [t for e in events if isinstance(e, Chunk) for t in e.token_ids] == [1, 2, 3, 4]
    assert len(woken) == 1 and transport.opened[1].replica.address == woken[0]
    assert transport.opened[1].starts[0].resume_ids == (1, 2)  # resumed, not started again
    done = events[-1]
    assert isinstance(done, Done) and done.route.reason == "failover" and done.route.worker_id == woken[0]
