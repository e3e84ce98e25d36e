"""Worker.Sleep and Worker.Wake over real gRPC (a worker on port 0 with a scripted engine): the
replies and Stats carry the model state; an engine without sleep, a busy worker with only_if_idle
and a call without the internal credential get their status codes; a Wake whose caller goes away
leaves the worker asleep again after the load."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from services.common.config import load_settings
from services.common.model_state import ModelState
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerSettings
from services.worker.server import RunningWorker, start_worker
from services.worker.types import Engine
from tests.unit.worker.fakes import TOKENIZER, FakeEngine, SleepyEngine
from tests.worker_helpers import META, generate

PROMPT = TOKENIZER.encode("hi")


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _serve(engine: Engine) -> tuple[RunningWorker, grpc.aio.Channel]:
    settings = load_settings(WorkerSettings, port=0, worker_id="w-s", shutdown_grace_s=0)
    worker = await start_worker(settings, engine, tier="edge")
    return worker, grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")


@pytest.fixture
async def sleepy() -> AsyncIterator[tuple[SleepyEngine, RunningWorker, worker_pb2_grpc.WorkerStub]]:
    engine = SleepyEngine(step_s=0.02)
    worker, channel = await _serve(engine)
    try:
        yield engine, worker, worker_pb2_grpc.WorkerStub(channel)
    finally:
        await channel.close()
        await worker.stop()


async def test_sleep_and_wake_replies_and_stats_carry_the_model_state(sleepy: tuple) -> None:  # type: ignore[type-arg]
    engine, _, stub = sleepy
    slept = await stub.Sleep(worker_pb2.SleepRequest(only_if_idle=True), metadata=META)
    assert slept.model_state == worker_pb2.MODEL_STATE_ASLEEP and slept.resident_bytes > 0
    stats = await stub.Stats(worker_pb2.StatsRequest(), metadata=META)
    assert stats.model_state == worker_pb2.MODEL_STATE_ASLEEP and stats.resident_bytes > 0
    woke = await stub.Wake(worker_pb2.WakeRequest(), metadata=META)
    assert woke.model_state == worker_pb2.MODEL_STATE_AWAKE and engine.restored == 1
    assert (await stub.Stats(worker_pb2.StatsRequest(), metadata=META)).model_state == worker_pb2.MODEL_STATE_AWAKE


async def test_only_if_idle_while_a_turn_runs_is_failed_precondition(sleepy: tuple) -> None:  # type: ignore[type-arg]
    _, worker, stub = sleepy
    turn = asyncio.ensure_future(generate(stub, PROMPT, max_tokens=60))
    await _until(lambda: bool(worker.runner.running), "the turn runs")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Sleep(worker_pb2.SleepRequest(only_if_idle=True), metadata=META)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert len((await turn).token_ids) == 60


async def test_a_wake_whose_caller_goes_away_sends_the_worker_back_to_sleep(sleepy: tuple) -> None:  # type: ignore[type-arg]
    engine, worker, stub = sleepy
    await stub.Sleep(worker_pb2.SleepRequest(), metadata=META)
    engine.restore_gate = threading.Event()
    call = stub.Wake(worker_pb2.WakeRequest(), metadata=META)
    await _until(lambda: worker.runner.model.state is ModelState.WAKING, "the load starts")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await _until(lambda: not worker.runner.model._callers, "the server saw the cancel")
    engine.restore_gate.set()
    await _until(lambda: engine.restored == 1 and worker.runner.model.state is ModelState.ASLEEP, "back asleep")
    assert engine.released == 2


async def test_an_engine_without_sleep_and_a_call_without_the_credential_are_refused() -> None:
    worker, channel = await _serve(FakeEngine())
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Sleep(worker_pb2.SleepRequest(), metadata=META)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.Wake(worker_pb2.WakeRequest())
        assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
    finally:
        await channel.close()
        await worker.stop()
