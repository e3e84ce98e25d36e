"""Sleep and wake on a real edge worker process (``python -m services.edge_worker``, the real INT4
model): asleep, its resident memory drops well below awake; awake again, the same greedy tokens; a
Generate to an asleep worker wakes it and answers; eight concurrent Wakes share one load; a host
short of memory refuses the wake and the worker stays asleep."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.worker_cases import SleepingWorker, sleeping_worker
from tests.worker_helpers import META, generate

pytestmark = pytest.mark.integration
PROMPT = [1, 4093, 28, 2683, 1460, 11542, 30, 2]
ASLEEP, AWAKE = worker_pb2.MODEL_STATE_ASLEEP, worker_pb2.MODEL_STATE_AWAKE


@pytest.fixture(scope="module")
async def worker() -> AsyncIterator[SleepingWorker]:
    async with sleeping_worker("services.edge_worker", "MESHSERVE_EDGE_WORKER_") as running:
        yield running


async def test_asleep_the_worker_gives_its_memory_back_and_awake_again_it_answers_the_same(
    worker: SleepingWorker,
) -> None:
    stub = worker.stub
    before = await generate(stub, PROMPT, max_tokens=12)
    awake = await stub.Stats(worker_pb2.StatsRequest(), metadata=META)
    assert awake.model_state == AWAKE and awake.resident_bytes > 0
    slept = await stub.Sleep(worker_pb2.SleepRequest(only_if_idle=True), metadata=META)
    assert slept.model_state == ASLEEP
    asleep = await stub.Stats(worker_pb2.StatsRequest(), metadata=META)
    assert asleep.model_state == ASLEEP
    assert asleep.resident_bytes < 0.5 * awake.resident_bytes, (asleep.resident_bytes, awake.resident_bytes)
    again = await stub.Sleep(worker_pb2.SleepRequest(), metadata=META)  # idempotent
    assert again.model_state == ASLEEP and again.seconds == 0
    woke = await stub.Wake(worker_pb2.WakeRequest(), metadata=META)
    assert woke.model_state == AWAKE and woke.seconds > 0
    assert (await stub.Stats(worker_pb2.StatsRequest(), metadata=META)).model_state == AWAKE
    after = await generate(stub, PROMPT, max_tokens=12)
    assert after.token_ids == before.token_ids and after.text == before.text


async def test_a_generate_to_an_asleep_worker_wakes_it_and_answers(worker: SleepingWorker) -> None:
    stub = worker.stub
    before = await generate(stub, PROMPT, max_tokens=8)
    await stub.Sleep(worker_pb2.SleepRequest(), metadata=META)
    loads = worker.count("model_woken")
    after = await generate(stub, PROMPT, max_tokens=8)
    assert after.token_ids == before.token_ids
    assert (await stub.Stats(worker_pb2.StatsRequest(), metadata=META)).model_state == AWAKE
    await worker.wait_count("model_woken", loads + 1)


async def test_eight_concurrent_wakes_share_one_load(worker: SleepingWorker) -> None:
    stub = worker.stub
    await stub.Sleep(worker_pb2.SleepRequest(), metadata=META)
    loads = worker.count("model_woken")
    replies = await asyncio.gather(*(stub.Wake(worker_pb2.WakeRequest(), metadata=META) for _ in range(8)))
    assert {r.model_state for r in replies} == {AWAKE}
    await worker.wait_count("model_woken", loads + 1)
    assert worker.count("model_woken") == loads + 1  # awake once all replied: no second load can start
    assert len({r.seconds for r in replies if r.seconds > 0}) == 1  # one load's time, shared


async def test_sleep_only_if_idle_is_refused_while_a_turn_runs(worker: SleepingWorker) -> None:
    stub = worker.stub
    await stub.Wake(worker_pb2.WakeRequest(), metadata=META)
    turn = asyncio.ensure_future(generate(stub, PROMPT, max_tokens=64))
    while (await stub.Stats(worker_pb2.StatsRequest(), metadata=META)).active_sequences == 0:
        await asyncio.sleep(0.01)
        assert not turn.done(), "the turn ended before it could be seen running"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Sleep(worker_pb2.SleepRequest(only_if_idle=True), metadata=META)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    result = await turn
    assert result.final is not None and result.token_ids


async def test_a_host_short_of_memory_refuses_the_wake_and_the_worker_stays_asleep() -> None:
    huge = str(1 << 50)  # a margin no host has: the wake must be refused before it loads anything
    async with sleeping_worker(
        "services.edge_worker", "MESHSERVE_EDGE_WORKER_", MESHSERVE_EDGE_WORKER_SLEEP_MEMORY_MARGIN_BYTES=huge
    ) as running:
        stub = running.stub
        await stub.Sleep(worker_pb2.SleepRequest(), metadata=META)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Wake(worker_pb2.WakeRequest(), metadata=META)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "memory" in (refused.value.details() or "")
        assert (await stub.Stats(worker_pb2.StatsRequest(), metadata=META)).model_state == ASLEEP
        assert running.count("model_wake_refused_no_memory") == 1


async def test_stats_of_a_worker_that_never_slept_say_awake(worker: SleepingWorker) -> None:
    stub: worker_pb2_grpc.WorkerStub = worker.stub
    await stub.Wake(worker_pb2.WakeRequest(), metadata=META)
    reply = await stub.Wake(worker_pb2.WakeRequest(), metadata=META)  # awake already: nothing to do
    assert reply.model_state == AWAKE and reply.seconds == 0
