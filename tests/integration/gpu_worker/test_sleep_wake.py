"""Sleep and wake on a real cloud worker process (``python -m services.gpu_worker``, CPU): asleep, the
weights and KV are released and its resident memory drops; awake again, the same greedy tokens; a
Generate to an asleep worker wakes it and answers; eight concurrent Wakes share one load."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.pb.meshserve.internal.v1 import worker_pb2
from tests.integration.worker_cases import SleepingWorker, sleeping_worker
from tests.worker_helpers import META, generate

pytestmark = pytest.mark.integration
PROMPT = [1, 4093, 28, 2683, 1460, 11542, 30, 2]
ASLEEP, AWAKE = worker_pb2.MODEL_STATE_ASLEEP, worker_pb2.MODEL_STATE_AWAKE


@pytest.fixture(scope="module")
async def worker() -> AsyncIterator[SleepingWorker]:
    async with sleeping_worker("services.gpu_worker", "MESHSERVE_GPU_WORKER_", MESHSERVE_GPU_WORKER_DEVICE="cpu") as w:
        yield w


async def test_asleep_the_cloud_worker_gives_its_memory_back_and_awake_again_it_answers_the_same(
    worker: SleepingWorker,
) -> None:
    stub = worker.stub
    before = await generate(stub, PROMPT, max_tokens=12)
    awake = await stub.Stats(worker_pb2.StatsRequest(), metadata=META)
    slept = await stub.Sleep(worker_pb2.SleepRequest(only_if_idle=True), metadata=META)
    assert slept.model_state == ASLEEP
    asleep = await stub.Stats(worker_pb2.StatsRequest(), metadata=META)
    assert asleep.model_state == ASLEEP and asleep.kv_used_bytes == 0
    assert asleep.resident_bytes < 0.5 * awake.resident_bytes, (asleep.resident_bytes, awake.resident_bytes)
    woke = await stub.Wake(worker_pb2.WakeRequest(), metadata=META)
    assert woke.model_state == AWAKE
    after = await generate(stub, PROMPT, max_tokens=12)
    assert after.token_ids == before.token_ids


async def test_a_generate_to_an_asleep_cloud_worker_wakes_it_and_eight_wakes_share_one_load(
    worker: SleepingWorker,
) -> None:
    stub = worker.stub
    before = await generate(stub, PROMPT, max_tokens=6)
    await stub.Sleep(worker_pb2.SleepRequest(), metadata=META)
    loads = worker.count("model_woken")
    assert (await generate(stub, PROMPT, max_tokens=6)).token_ids == before.token_ids
    await worker.wait_count("model_woken", loads + 1)
    await stub.Sleep(worker_pb2.SleepRequest(), metadata=META)
    replies = await asyncio.gather(*(stub.Wake(worker_pb2.WakeRequest(), metadata=META) for _ in range(8)))
    assert {r.model_state for r in replies} == {AWAKE}
    await worker.wait_count("model_woken", loads + 2)
    assert worker.count("model_woken") == loads + 2
