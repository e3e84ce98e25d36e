"""The real edge worker under concurrent streams: same tokens as alone, bounded queue, cancel frees slots."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.pb.meshserve.v1.inference_pb2 import FINISH_REASON_CANCELLED
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.server import start_edge_worker
from services.worker.server import RunningWorker
from tests.worker_helpers import (
    CANCEL,
    Session,
    cancel_during_prefill,
    generate,
    start_frame,
    stats,
    wait_idle,
    wait_serving,
)

pytestmark = pytest.mark.integration
PROMPTS = ["Name three colours.", "What is the sea?", "Tell me a short story.", "Count to five."]


@pytest.fixture(scope="module")
async def worker() -> AsyncIterator[RunningWorker]:
    settings = load_settings(
        EdgeWorkerSettings, port=0, threads=1, max_active_sequences=2, max_queue=2, worker_id="edge-conc"
    )
    running = await start_edge_worker(settings)
    yield running
    await running.stop()


@pytest.fixture
async def stub(worker: RunningWorker) -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        await wait_serving(channel, "meshserve.internal.v1.Worker")
        yield worker_pb2_grpc.WorkerStub(channel)


def chat_ids(worker: RunningWorker, text: str) -> list[int]:
    chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(worker.runner.engine.tokenizer.encode(chat).ids)  # type: ignore[attr-defined]


async def test_concurrent_greedy_streams_equal_single_stream_output(
    worker: RunningWorker, stub: worker_pb2_grpc.WorkerStub
) -> None:
    prompts = [chat_ids(worker, p) for p in PROMPTS]
    alone = [(await generate(stub, p, max_tokens=10)).token_ids for p in prompts]
    together = await asyncio.gather(*(generate(stub, p, max_tokens=10) for p in prompts))  # 2 run, 2 queue
    assert [r.token_ids for r in together] == alone


async def test_full_queue_is_resource_exhausted_and_cancel_frees_the_slot(
    worker: RunningWorker, stub: worker_pb2_grpc.WorkerStub
) -> None:
    prompt = chat_ids(worker, PROMPTS[0])
    running = [Session(stub) for _ in range(2)]
    for session in running:
        await session.call.write(start_frame(prompt, max_tokens=400))
        await session.read()  # generating: both slots taken
    queued = [Session(stub) for _ in range(2)]
    for session in queued:
        await session.call.write(start_frame(prompt, max_tokens=3))
    deadline = asyncio.get_running_loop().time() + 10
    while (await stats(stub)).queue_depth < 2:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)  # polling a condition, not readiness
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, prompt, max_tokens=3)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Cancelling one running stream frees its slot at once: a queued turn is admitted and finishes.
    await running[0].call.write(CANCEL)
    while not (await running[0].read()).HasField("final"):
        pass
    first_queued = await queued[0].turn_rest()
    assert len(first_queued.token_ids) == 3
    await running[1].call.write(CANCEL)
    while not (await running[1].read()).HasField("final"):
        pass
    assert len((await queued[1].turn_rest()).token_ids) == 3
    for session in running + queued:
        await session.call.done_writing()
    current = await wait_idle(stub)
    assert current.active_sequences == 0 and current.queue_depth == 0


async def test_cancel_during_a_long_prefill_stops_it_after_the_chunk_in_progress(
    worker: RunningWorker, stub: worker_pb2_grpc.WorkerStub
) -> None:
    engine = worker.runner.engine
    prompt = chat_ids(worker, "sea wave ship " * 700)
    chunks = -(-len(prompt) // engine.prefill_chunk)  # type: ignore[attr-defined]
    assert chunks >= 4, len(prompt)
    before = engine.prefill_calls  # type: ignore[attr-defined]
    session, final = await cancel_during_prefill(
        stub,
        prompt,
        lambda: engine.prefill_calls > before,  # type: ignore[attr-defined]
    )
    assert final.finish_reason == FINISH_REASON_CANCELLED and final.completion_tokens == 0
    await wait_idle(stub)
    # Before, a cancel waited for the whole prefill (the stop flag is checked between steps only).
    assert engine.prefill_calls - before < chunks  # type: ignore[attr-defined]
    # The interrupted sequence is not kept for the stream's next turn, which starts afresh.
    result = await session.turn(chat_ids(worker, PROMPTS[0]), max_tokens=3)
    assert len(result.token_ids) == 3
    await session.call.done_writing()
