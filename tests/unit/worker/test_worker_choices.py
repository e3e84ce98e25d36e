"""n choices as one worker turn (fake engine, real gRPC server on port 0): frames carry their choice's
index, each choice ends with its own final, the turn ends after the n-th; the choices after the first
are forks of it where the engine declares forks (one prefill), else independent sequences; n slots
are taken at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.worker.slots import Admission
from tests.unit.worker.fakes import TOKENIZER, FakeEngine
from tests.unit.worker.test_worker_servicer import PROMPT, serve
from tests.worker_helpers import CANCEL, META, Session, start_frame, wait_idle


class ForkingEngine(FakeEngine):
    """A fake engine that declares forks."""

    def __init__(self) -> None:
        super().__init__("hello world", forks=True)


async def turn(stub: worker_pb2_grpc.WorkerStub, **sampling: Any) -> list[worker_pb2.WorkerResponse]:
    async def requests() -> AsyncIterator[worker_pb2.WorkerRequest]:
        yield start_frame(PROMPT, **sampling)

    return [r async for r in stub.Generate(requests(), metadata=META) if not r.queued]


def by_choice(frames: list[worker_pb2.WorkerResponse], n: int) -> tuple[list[str], list[worker_pb2.WorkerFinal]]:
    texts = ["" for _ in range(n)]
    finals: list[Any] = [None] * n
    for frame in frames:
        assert finals[frame.index] is None  # nothing of a choice after its final
        texts[frame.index] += frame.text
        if frame.HasField("final"):
            finals[frame.index] = frame.final
    return texts, finals


@pytest.fixture(params=[FakeEngine, ForkingEngine])
async def worker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FakeEngine, worker_pb2_grpc.WorkerStub]]:
    engine = request.param() if request.param is ForkingEngine else request.param("hello world")
    running = await serve(engine, max_active_sequences=4)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield engine, worker_pb2_grpc.WorkerStub(channel)
    finally:
        await channel.close()
        await running.stop()


async def test_greedy_choices_each_end_with_their_own_final(worker: Any) -> None:
    engine, stub = worker
    added = len(engine.added)  # the warm-up's
    frames = await turn(stub, max_tokens=3, n=3)
    assert [f.sequence for f in frames] == list(range(len(frames)))  # all choices numbered together
    assert sum(f.HasField("final") for f in frames) == 3 and frames[-1].HasField("final")
    texts, finals = by_choice(frames, 3)
    assert texts == ["hello worldhello"] * 3  # greedy: n equal choices
    assert [(f.prompt_tokens, f.completion_tokens) for f in finals] == [(len(PROMPT), 3)] * 3
    seqs = engine.added[added:]
    assert len(seqs) == 3
    if isinstance(engine, ForkingEngine):  # the other choices are made from the first one's prefill
        assert [s.fork_of for s in seqs] == [None, seqs[0].id, seqs[0].id]
    else:
        assert [s.fork_of for s in seqs] == [None, None, None]


async def test_seeded_choices_sample_with_seed_plus_i(worker: Any) -> None:
    _, stub = worker
    texts, _ = by_choice(await turn(stub, max_tokens=2, temperature=1.0, seed=5, n=2), 2)
    alone = [by_choice(await turn(stub, max_tokens=2, temperature=1.0, seed=s), 1)[0][0] for s in (5, 6)]
    assert texts == alone and texts[0] != texts[1]


async def test_more_choices_than_the_worker_runs_at_once_is_invalid_argument(worker: Any) -> None:
    _, stub = worker
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await turn(stub, max_tokens=2, n=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 4 choices" in (err.value.details() or "")


async def test_a_turn_of_n_choices_takes_n_slots_at_once() -> None:
    admission = Admission(max_active=3, max_queue=4)
    never = asyncio.Event()
    assert admission.try_acquire(2)
    waiting = asyncio.ensure_future(admission.acquire(never, 2))  # 1 free: waits for both
    small = asyncio.ensure_future(admission.acquire(never, 1))  # FIFO: behind the pair
    await asyncio.sleep(0.01)
    assert not waiting.done() and not small.done() and admission.active == 2
    admission.release(1)
    await asyncio.sleep(0.01)
    assert waiting.done() and not small.done() and admission.active == 3
    admission.release(2)
    await asyncio.sleep(0.01)
    assert small.done() and admission.active == 2
    admission.release(2)
    assert admission.active == 0


def test_the_fake_tokenizer_spells_the_script() -> None:
    assert TOKENIZER.decode(TOKENIZER.encode("hello world")) == "hello world"


async def test_a_cancel_ends_every_choice_and_frees_all_their_slots(worker: Any) -> None:
    engine, stub = worker
    engine.step_s = 0.01
    session = Session(stub)
    await session.call.write(start_frame(PROMPT, max_tokens=60, n=3))
    await session.read()
    await session.call.write(CANCEL)
    reasons = {}
    while len(reasons) < 3:
        frame = await session.read()
        if frame.HasField("final"):
            reasons[frame.index] = frame.final.finish_reason
    assert set(reasons.values()) == {pb.FINISH_REASON_CANCELLED}
    after = await wait_idle(stub)
    assert after.active_sequences == 0
    assert after.tokens_generated_total < 3 * 30
    session.call.cancel()
