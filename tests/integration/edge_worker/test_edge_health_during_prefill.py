"""Fuzz finding 8: the only edge worker must keep answering the router's probes during a long prefill.

The router probes gRPC health and then Stats (0.5 s timeout each) and ejects a worker that misses
them. A model call that held the GIL (onnxruntime-genai's) stopped the worker's event loop for the
whole prefill; the batched engine's onnxruntime calls release it, so probes are answered while the
prompt is being prefilled. The bound is relative to the prefill's own duration, so a loaded machine
(which slows both) does not make the test flaky, while a loop blocked by the prefill fails it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.server import start_edge_worker
from services.worker.server import RunningWorker
from tests.worker_helpers import generate, stats, wait_serving

pytestmark = pytest.mark.integration
PROMPT_TOKENS = 768  # two prefill chunks of the default 512
TEXT = "The quick brown fox jumps over the lazy dog while the sailors sing of the sea. "


@pytest.fixture(scope="module")
async def worker() -> AsyncIterator[RunningWorker]:
    settings = load_settings(EdgeWorkerSettings, port=0, threads=1, warmup=False, worker_id="edge-prefill")
    running = await start_edge_worker(settings)
    yield running
    await running.stop()


async def test_health_and_stats_answer_while_a_long_prompt_is_prefilled(worker: RunningWorker) -> None:
    tokenizer = worker.runner.engine.tokenizer
    prompt = list(tokenizer.encode(TEXT * 60).ids)[:PROMPT_TOKENS]  # type: ignore[attr-defined]
    assert len(prompt) == PROMPT_TOKENS
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        await wait_serving(channel, "meshserve.internal.v1.Worker")
        stub = worker_pb2_grpc.WorkerStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        loop = asyncio.get_running_loop()
        waits: list[float] = []
        async with asyncio.timeout(600):  # bounded even on a very slow machine
            started = loop.time()
            turn = asyncio.create_task(generate(stub, prompt, max_tokens=1))
            while not turn.done():
                sent = loop.time()
                answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
                await stats(stub)  # the router's probe is health, then Stats
                waits.append(loop.time() - sent)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
                await asyncio.sleep(0.05)
            result = await turn
            prefill_s = loop.time() - started
    assert result.final is not None and result.final.prefill_tokens == PROMPT_TOKENS
    assert len(waits) >= 5, f"only {len(waits)} probes answered during a {prefill_s:.1f} s prefill"
    assert max(waits) < prefill_s / 3, f"a probe waited {max(waits):.2f} s of a {prefill_s:.1f} s prefill"
