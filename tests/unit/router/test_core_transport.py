"""The router core over the worker-transport interface alone (services/router/worker_stream.py): a
fake transport whose streams play scripted frames and failures, no network, no pb. Retries before
the first token, resumption after it (prompt + tokens sent, no gap or duplicate), a worker's own
error passed on, and a stalled worker ejected."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import pytest

from services.common import errors
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer
from services.router.core import Chunk, Done, Router, Session, TurnRequest
from services.router.policy import TierName
from services.router.registry import Registry, Replica
from services.router.worker_stream import Frame, TurnFinal, TurnStart, WorkerFailed
from services.store.response_cache import ResponseCache

Step = list[int] | WorkerFailed | None
"""One scripted step of a turn: a frame of these tokens, a failure, or silence (a stall)."""


@dataclass
class FakeStream:
    replica: Replica
    script: list[Step]
    starts: list[TurnStart] = field(default_factory=list)
    closed: bool = False
    _n: int = 0  # frames are numbered per turn from 0

    async def start(self, start: TurnStart) -> None:
        self.starts.append(replace(start, resume_ids=tuple(start.resume_ids)))  # as sent, not as it grows

    async def cancel_turn(self) -> None:
        self.script[:] = []

    async def read(self) -> Frame:
        step: Step | str = self.script.pop(0) if self.script else "final"
        if isinstance(step, WorkerFailed):
            raise step
        if step is None:
            await asyncio.Event().wait()
        n = self._n
        self._n += 1
        if step == "final":
            return Frame(n, [], "", final=TurnFinal(1, 3, n, 3))
        assert isinstance(step, list)
        return Frame(n, step, "".join(f" t{t}" for t in step))

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


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(model_paths().hf_dir)


@pytest.fixture
async def cache() -> AsyncIterator[ResponseCache]:
    cache = ResponseCache.from_url("")
    yield cache
    await cache.close()


def _router(tokenizer: Tokenizer, cache: ResponseCache, transport: FakeTransport) -> Router:
    registry = Registry([], [], internal_token="t")
    for address in ("edge-a", "edge-b", "edge-c"):
        registry.replicas.append(Replica(address, TierName.EDGE, None, None, healthy=True))  # type: ignore[arg-type]
    return Router(
        tokenizer=tokenizer,
        cache=cache,
        registry=registry,
        model_id="m",
        model_version="v1",
        internal_token="t",
        edge_max_prompt_tokens=1000,
        policy="round_robin",
        stall_timeout_s=0.2,
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
    assert second.starts[0].prompt_ids == [5, 6, 7]
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
