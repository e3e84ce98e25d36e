"""The router core over the worker-transport interface alone (services/router/balancer/worker_stream.py): a
fake transport whose streams play scripted frames and failures, no network, no pb. Retries before
the first token, resumption after it (prompt + tokens sent, no gap or duplicate; on a replica of the
same build first, waiting a bounded time for one), a worker's own error passed on, and a stalled
worker ejected."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import pytest

from services.common import errors
from services.common.generation import GenerationEvent, GenerationRequest
from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer
from services.router.balancer.core import Chunk, Done, Router, Session, TurnRequest
from services.router.balancer.policies.round_robin import RoundRobin
from services.router.balancer.registry import Registry, Replica, WorkerReport
from services.router.balancer.tiers import TierName
from services.router.balancer.worker_stream import WorkerFailed
from services.store.response_cache import ResponseCache
from tests.worker_helpers import worker_final, worker_frame

Step = list[int] | WorkerFailed | None
"""One scripted step of a turn: a frame of these tokens, a failure, or silence (a stall)."""


@dataclass
class FakeStream:
    replica: Replica
    script: list[Step]
    starts: list[GenerationRequest] = field(default_factory=list)
    closed: bool = False
    _n: int = 0  # frames are numbered per turn from 0

    async def start(self, start: GenerationRequest) -> None:
        self.starts.append(replace(start, resume_ids=tuple(start.resume_ids)))  # as sent, not as it grows

    async def cancel_turn(self) -> None:
        self.script[:] = []

    async def read(self) -> GenerationEvent:
        step: Step | str = self.script.pop(0) if self.script else "final"
        if isinstance(step, WorkerFailed):
            raise step
        if step is None:
            await asyncio.Event().wait()
        n = self._n
        self._n += 1
        if step == "final":
            return worker_frame(n, [], "", final=worker_final(1, 3, n, 3))
        assert isinstance(step, list)
        return worker_frame(n, step, "".join(f" t{t}" for t in step))

    def abort(self) -> None:
        self.closed = True

    async def close(self) -> None:
        self.closed = True


class FakeTransport:
    """Opens a FakeStream with the script queued for its replica's address."""

    def __init__(self, scripts: dict[str, list[list[Step]]]) -> None:
        self.scripts = scripts
        self.opened: list[FakeStream] = []

    def open(self, replica: Replica, timeout: float | None) -> FakeStream:
        stream = FakeStream(replica, self.scripts[replica.address].pop(0))
        self.opened.append(stream)
        return stream

    def retire(self, address: str) -> None:
        pass

    async def close(self) -> None:
        pass


def _router(
    tokenizer: Tokenizer,
    cache: ResponseCache,
    transport: FakeTransport,
    builds: dict[str, str] | None = None,
    same_build_wait_s: float = 5.0,
) -> Router:
    """Replicas edge-a, edge-b, edge-c (edge, no build reported) unless ``builds`` names them: address ->
    build, a ``cloud-`` address on the cloud tier."""
    registry = Registry([], [], internal_token="t")
    for address, build in (builds or dict.fromkeys(("edge-a", "edge-b", "edge-c"), "")).items():
        tier = TierName.CLOUD if address.startswith("cloud-") else TierName.EDGE
        replica = Replica(address, tier, None, None, healthy=True, report=WorkerReport(build=build))  # type: ignore[arg-type]
        registry.replicas.append(replica)
    return Router(
        tokenizer=tokenizer,
        cache=cache,
        registry=registry,
        model_id="m",
        model_version="v1",
        internal_token="t",
        edge_max_prompt_tokens=1000,
        selector=RoundRobin(),
        stall_timeout_s=0.2,
        resume_same_build_wait_s=same_build_wait_s,
        transport=transport,
    )


def _request() -> TurnRequest:
    return TurnRequest([5, 6, 7], SamplingParams(max_tokens=8), TierName.EDGE, False, False, "acme", "req-1")


async def _run(router: Router) -> list[Chunk | Done]:
    return [event async for event in router.run_turn(_request(), Session())]


def _unavailable() -> WorkerFailed:
    return WorkerFailed("UNAVAILABLE", errors.Unavailable("the worker serving this request failed"), "gone")


async def test_a_failure_before_the_first_token_is_retried_on_another_worker(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    transport = FakeTransport({"edge-a": [[_unavailable()]], "edge-b": [[[1], [2]]], "edge-c": [[[1], [2]]]})
    router = _router(tokenizer, cache, transport)
    events = await _run(router)
    assert [t for e in events if isinstance(e, Chunk) for t in e.token_ids] == [1, 2]
    done = events[-1]
    assert isinstance(done, Done) and done.route.worker_id != "edge-a"
    assert not router.registry.replicas[0].healthy  # the failed worker is ejected
    assert transport.opened[0].closed


async def test_a_worker_dying_after_tokens_is_resumed_elsewhere_without_gap_or_duplicate(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    transport = FakeTransport({"edge-a": [[[1], [2], _unavailable()]], "edge-b": [[[3], [4]]], "edge-c": [[[3], [4]]]})
    events = await _run(_router(tokenizer, cache, transport))
    assert [t for e in events if isinstance(e, Chunk) for t in e.token_ids] == [1, 2, 3, 4]
    first, second = transport.opened
    assert first.starts[0].resume_ids == () and second.starts[0].resume_ids == (1, 2)  # prompt + tokens sent
    assert second.starts[0].prompt_ids == (5, 6, 7)
    done = events[-1]
    assert isinstance(done, Done) and done.route.reason == "failover"


async def test_a_workers_own_error_is_passed_on_without_a_retry(tokenizer: Tokenizer, cache: ResponseCache) -> None:
    rejected = WorkerFailed("INVALID_ARGUMENT", errors.InvalidArgument("the parameters were rejected"), "bad")
    transport = FakeTransport({"edge-a": [[rejected]], "edge-b": [[[1]]], "edge-c": [[[1]]]})
    router = _router(tokenizer, cache, transport)
    with pytest.raises(errors.InvalidArgument):
        await _run(router)
    assert len(transport.opened) == 1 and router.registry.replicas[0].healthy


async def test_a_stalled_worker_is_ejected_and_resumed_elsewhere(tokenizer: Tokenizer, cache: ResponseCache) -> None:
    transport = FakeTransport({"edge-a": [[[1], None]], "edge-b": [[[2]]], "edge-c": [[[2]]]})
    router = _router(tokenizer, cache, transport)
    events = await _run(router)
    assert [t for e in events if isinstance(e, Chunk) for t in e.token_ids] == [1, 2]
    assert not router.registry.replicas[0].healthy


INT4, FP32 = "m@v1/onnx-int4:edge-int4/batched", "m@v1/torch:cpu/float32"


def _tokens(events: list[Chunk | Done]) -> list[int]:
    return [t for e in events if isinstance(e, Chunk) for t in e.token_ids]


async def test_a_resume_prefers_a_replica_of_the_same_build(tokenizer: Tokenizer, cache: ResponseCache) -> None:
    # Round-robin alone resumes on edge-c (another build, same tier), next in turn after edge-a.
    scripts: dict[str, list[list[Step]]] = {"edge-a": [[[1], [2], _unavailable()]], "edge-b": [[[3]]]}
    transport = FakeTransport({**scripts, "edge-c": [[[9]]], "cloud-d": [[[9]]]})
    router = _router(tokenizer, cache, transport, {"edge-a": INT4, "edge-b": INT4, "edge-c": FP32, "cloud-d": FP32})
    events = await _run(router)
    assert _tokens(events) == [1, 2, 3]
    done = events[-1]
    assert isinstance(done, Done) and (done.route.worker_id, done.route.reason) == ("edge-b", "failover")


async def test_a_resume_waits_for_a_slot_of_the_same_build_then_takes_it(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    transport = FakeTransport({"edge-a": [[[1], _unavailable()]], "edge-b": [[[2]]], "cloud-d": [[[9]]]})
    router = _router(tokenizer, cache, transport, {"edge-a": INT4, "edge-b": INT4, "cloud-d": FP32})
    busy = router.registry.replicas[1]
    busy.in_flight = busy.max_active  # every slot of the other INT4 replica is taken

    async def free_a_slot() -> None:
        await asyncio.sleep(0.1)  # a turn of the busy replica ends while the resume waits
        busy.in_flight -= 1
        router._freed_slot()

    freeing = asyncio.create_task(free_a_slot())
    events = await _run(router)
    await freeing
    done = events[-1]
    assert isinstance(done, Done) and (done.route.worker_id, done.route.reason) == ("edge-b", "failover")
    assert _tokens(events) == [1, 2]


async def test_a_resume_crosses_builds_after_the_bounded_wait_and_says_so(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    transport = FakeTransport({"edge-a": [[[1], _unavailable()]], "edge-b": [[[2]]], "cloud-d": [[[7], [8]]]})
    router = _router(tokenizer, cache, transport, {"edge-a": INT4, "edge-b": INT4, "cloud-d": FP32}, 0.2)
    busy = router.registry.replicas[1]
    busy.in_flight = busy.max_active
    router.admission = type(router.admission)(lambda tier: 1 if tier is TierName.EDGE else 4)  # edge saturated
    loop = asyncio.get_running_loop()
    began = loop.time()
    events = await _run(router)
    assert loop.time() - began >= 0.2  # it waited the bound for an INT4 slot first
    done = events[-1]
    assert isinstance(done, Done) and (done.route.worker_id, done.route.reason) == ("cloud-d", "failover_cross_build")
    assert _tokens(events) == [1, 7, 8]
    assert transport.opened[-1].starts[0].resume_ids == (1,)


async def test_a_resume_with_no_replica_of_its_build_crosses_at_once(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    transport = FakeTransport({"edge-a": [[[1], _unavailable()]], "cloud-d": [[[7]]]})
    router = _router(tokenizer, cache, transport, {"edge-a": INT4, "cloud-d": FP32}, 30.0)
    events = await asyncio.wait_for(_run(router), 5)  # no wait: nothing of its build could free up
    done = events[-1]
    assert isinstance(done, Done) and (done.route.worker_id, done.route.reason) == ("cloud-d", "failover_cross_build")
