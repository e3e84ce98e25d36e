"""The generic Worker servicer over a fake engine, through a real gRPC server on port 0."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.common.config import DEFAULT_INTERNAL_TOKEN, load_settings
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.serving import MAX_MESSAGE_BYTES
from services.router.balancer.stream_transport import StreamConnection
from services.worker.config import WorkerSettings
from services.worker.server import RunningWorker, start_worker
from tests.unit.worker.fakes import EOS, TOKENIZER, VOCAB, FakeEngine
from tests.worker_helpers import CANCEL, META, Session, fold, generate, start_frame, stats, wait_idle, wait_serving

PROMPT = TOKENIZER.encode("hi")


async def serve(engine: FakeEngine, **overrides: Any) -> RunningWorker:
    settings = load_settings(WorkerSettings, port=0, worker_id="w-1", **overrides)
    return await start_worker(settings, engine, tier="edge")


@pytest.fixture
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FakeEngine, worker_pb2_grpc.WorkerStub]]:
    kwargs = getattr(request, "param", {})
    engine = FakeEngine(**kwargs.pop("engine", {}))
    worker = await serve(engine, **kwargs)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
    try:
        yield engine, worker_pb2_grpc.WorkerStub(channel)
    finally:
        await channel.close()
        await worker.stop()


async def test_streams_tokens_then_length_final(harness: Any) -> None:
    engine, stub = harness
    result = await generate(stub, PROMPT, max_tokens=3)
    assert result.token_ids == TOKENIZER.encode("hello worldhello")
    assert result.text == "hello worldhello"
    # Numbered without gaps; tokens produced while a frame was written may share the next frame.
    assert _numbered(result.sequences, at_most=4)
    assert result.reason == pb.FINISH_REASON_LENGTH
    assert (result.final.prompt_tokens, result.final.completion_tokens, result.final.prefill_tokens) == (2, 3, 2)
    assert engine.started[-1][0] == PROMPT


@pytest.mark.parametrize(
    "harness", [{"engine": {"script": [*TOKENIZER.encode("ab"), EOS], "loop": False}}], indirect=True
)
async def test_eos_is_stop_and_not_sent(harness: Any) -> None:
    _, stub = harness
    result = await generate(stub, PROMPT, max_tokens=10)
    assert (result.token_ids, result.text, result.reason) == (TOKENIZER.encode("ab"), "ab", pb.FINISH_REASON_STOP)
    assert result.final.completion_tokens == 3


async def test_stop_string_split_across_tokens(harness: Any) -> None:
    _, stub = harness  # script: "hello", " world", repeated
    result = await generate(stub, PROMPT, max_tokens=10, stop=["o wor"])
    assert result.text == "hell"
    assert result.reason == pb.FINISH_REASON_STOP_STRING
    assert len(result.token_ids) == 2


async def test_held_stop_prefix_is_released_at_length(harness: Any) -> None:
    _, stub = harness
    result = await generate(stub, PROMPT, max_tokens=2, stop=["worldX"])
    assert (result.text, result.reason) == ("hello world", pb.FINISH_REASON_LENGTH)


@pytest.mark.parametrize(
    "harness", [{"engine": {"script": [VOCAB.index(b"\xc3"), VOCAB.index(b"\xa9")]}}], indirect=True
)
async def test_multibyte_character_split_across_tokens(harness: Any) -> None:
    _, stub = harness
    result = await generate(stub, PROMPT, max_tokens=3)
    assert result.text == "é\ufffd"


async def test_sampling_reaches_the_engine_resolved(harness: Any) -> None:
    engine, stub = harness
    first = await generate(stub, PROMPT, max_tokens=4, temperature=0.7, top_p=0.9, top_k=5, seed=11)
    second = await generate(stub, PROMPT, max_tokens=4, temperature=0.7, top_p=0.9, top_k=5, seed=11)
    assert first.token_ids == second.token_ids
    sampling = engine.started[-1][1]
    assert (
        sampling.max_tokens,
        round(sampling.temperature, 3),
        round(sampling.top_p, 3),
        sampling.top_k,
        sampling.seed,
    ) == (4, 0.7, 0.9, 5, 11)


async def test_resumed_tokens_are_prefilled_not_resent(harness: Any) -> None:
    engine, stub = harness
    resume = TOKENIZER.encode("ab")
    request = worker_pb2.WorkerRequest(
        start=worker_pb2.WorkerStart(
            prompt_token_ids=PROMPT, resume_token_ids=resume, sampling=pb.SamplingParams(max_tokens=5)
        )
    )

    async def requests() -> AsyncIterator[worker_pb2.WorkerRequest]:
        yield request

    result = fold([frame async for frame in stub.Generate(requests(), metadata=META)])
    assert engine.started[-1][0] == PROMPT + resume
    assert len(result.token_ids) == 3  # max_tokens covers the resumed tokens
    assert result.final.prompt_tokens == len(PROMPT) + len(resume)


async def test_two_turns_on_one_stream(harness: Any) -> None:
    engine, stub = harness
    session = Session(stub)
    first = await session.turn(PROMPT, max_tokens=2)
    context = PROMPT + first.token_ids + TOKENIZER.encode("ok")
    second = await session.turn(context, max_tokens=1)
    await session.call.done_writing()
    assert await session.call.read() is grpc.aio.EOF
    assert _numbered(first.sequences, at_most=3) and _numbered(second.sequences, at_most=2)
    assert engine.started[-1][0] == context
    assert second.final.prompt_tokens == len(context)


async def test_cancel_frame_stops_generation_and_frees_the_slot(harness: Any) -> None:
    engine, stub = harness
    engine.step_s = 0.01
    before = await stats(stub)
    session = Session(stub)
    await session.call.write(
        worker_pb2.WorkerRequest(
            start=worker_pb2.WorkerStart(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=60))
        )
    )
    await session.read()
    await session.call.write(CANCEL)
    frames = []
    while not (frame := await session.read()).HasField("final"):
        frames.append(frame)
    assert frame.final.finish_reason == pb.FINISH_REASON_CANCELLED
    after = await stats(stub)
    assert after.active_sequences == 0
    assert after.sequences_cancelled_total == before.sequences_cancelled_total + 1
    assert after.tokens_generated_total - before.tokens_generated_total < 30
    session.call.cancel()


async def test_starts_sent_too_far_ahead_end_the_stream_after_the_turn_in_progress(harness: Any) -> None:
    from services.worker.servicer import MAX_QUEUED_STARTS

    engine, stub = harness
    engine.step_s = 0.01
    session = Session(stub)
    started = len(engine.started)  # warm-up's

    def start(max_tokens: int) -> worker_pb2.WorkerRequest:
        sampling = pb.SamplingParams(max_tokens=max_tokens)
        return worker_pb2.WorkerRequest(start=worker_pb2.WorkerStart(prompt_token_ids=PROMPT, sampling=sampling))

    await session.call.write(start(30))
    frames = [await session.read()]  # the first turn runs (~0.3 s)
    for _ in range(MAX_QUEUED_STARTS + 1):
        await session.call.write(start(1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while True:
            frames.append(await session.read())
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finals = [f for f in frames if f.HasField("final")]
    assert len(finals) == 1 and finals[0].final.completion_tokens == 30
    assert len(engine.started) == started + 1  # no queued start ran


async def test_rpc_cancel_stops_generation(harness: Any) -> None:
    engine, stub = harness
    engine.step_s = 0.01
    before = await stats(stub)
    session = Session(stub)
    await session.call.write(
        worker_pb2.WorkerRequest(
            start=worker_pb2.WorkerStart(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=60))
        )
    )
    await session.read()
    session.call.cancel()
    idle = await wait_idle(stub)
    assert idle.sequences_cancelled_total == before.sequences_cancelled_total + 1
    steps = engine.steps
    await asyncio.sleep(0.1)  # the step in flight at the cancel may still end; nothing after it
    assert engine.steps <= steps + 1
    steps = engine.steps
    await asyncio.sleep(0.1)
    assert engine.steps == steps and not engine.live
    assert idle.tokens_generated_total - before.tokens_generated_total < 30


@pytest.mark.parametrize("harness", [{"max_active_sequences": 1, "max_queue": 1}], indirect=True)
async def test_queue_then_resource_exhausted(harness: Any) -> None:
    engine, stub = harness
    engine.gate = threading.Semaphore(0)
    first = asyncio.create_task(generate(stub, PROMPT, max_tokens=2))
    second = asyncio.create_task(generate(stub, PROMPT, max_tokens=2))
    deadline = time.monotonic() + 5
    while (current := await stats(stub)).queue_depth < 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert (current.active_sequences, current.max_active_sequences) == (1, 1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, PROMPT, max_tokens=2)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata() or ())["retry-after-ms"] == "500"
    for _ in range(4):
        engine.gate.release()
    assert [r.reason for r in await asyncio.gather(first, second)] == [pb.FINISH_REASON_LENGTH] * 2
    assert (await wait_idle(stub)).sequences_started_total >= 2


@pytest.mark.parametrize(
    "harness", [{"max_active_sequences": 1, "max_queue": 2, "queued_keepalive_s": 0.05}], indirect=True
)
async def test_a_queued_turn_sends_keepalives_then_its_numbered_frames(harness: Any) -> None:
    engine, stub = harness
    engine.gate = threading.Semaphore(0)
    first = asyncio.create_task(generate(stub, PROMPT, max_tokens=2))
    deadline = time.monotonic() + 5
    while (await stats(stub)).active_sequences < 1:  # the first turn holds the only slot
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    session = Session(stub)
    await session.call.write(start_frame(PROMPT, max_tokens=2))
    # The slot is held: only keepalives come.
    keepalives = [await asyncio.wait_for(session.read(), 5) for _ in range(3)]
    assert all(f.queued and not f.token_ids and not f.text and not f.HasField("final") for f in keepalives)
    for _ in range(4):
        engine.gate.release()
    second = await session.turn_rest()
    await session.call.done_writing()
    assert (await first).reason == second.reason == pb.FINISH_REASON_LENGTH
    assert _numbered(second.sequences, at_most=3) and second.token_ids == (await first).token_ids


async def test_stats_fields(harness: Any) -> None:
    _, stub = harness
    await generate(stub, PROMPT, max_tokens=3)
    current = await stats(stub)
    assert (current.worker_id, current.tier, current.model) == ("w-1", pb.TIER_EDGE, "fake-model")
    assert current.tokens_generated_total >= 3 and current.prefill_tokens_total >= 2
    assert current.recent_tokens_per_second > 0


async def test_missing_internal_token_is_permission_denied(harness: Any) -> None:
    _, stub = harness
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Stats(worker_pb2.StatsRequest())
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize(
    ("prompt", "sampling", "needle"),
    [
        ([], {}, "empty"),
        ([len(VOCAB)], {}, "out of range"),
        (PROMPT, {"max_tokens": 100}, "max_tokens"),
        (PROMPT, {"temperature": 3.0}, "temperature"),
    ],
)
async def test_bad_input_is_invalid_argument(
    harness: Any, prompt: list[int], sampling: dict[str, Any], needle: str
) -> None:
    _, stub = harness
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, prompt, **sampling)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (info.value.details() or "")


async def test_event_loop_is_not_blocked_by_model_work(harness: Any) -> None:
    engine, stub = harness
    engine.step_s = 0.2  # blocking sleep inside the engine, as a real model would block
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.gather(*(generate(stub, PROMPT, max_tokens=2) for _ in range(2)))
    stop.set()
    await task
    assert max(gaps) < 0.15, f"event loop blocked for {max(gaps):.3f} s"


async def test_health_waits_for_warmup_then_serves() -> None:
    worker = await serve(FakeEngine())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        await wait_serving(channel, "meshserve.internal.v1.Worker")
        assert (await generate(worker_pb2_grpc.WorkerStub(channel), PROMPT, max_tokens=1)).token_ids
    await worker.stop()


async def test_graceful_stop_lets_in_flight_turns_finish() -> None:
    engine = FakeEngine(step_s=0.02)
    worker = await serve(engine, shutdown_grace_s=5.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        session = Session(stub)
        await session.call.write(start_frame(PROMPT, max_tokens=10))
        await session.read()
        stopping = asyncio.create_task(worker.stop())
        result = await session.turn_rest()
        await session.call.done_writing()
        await stopping
    assert (len(result.token_ids), result.reason) == (9, pb.FINISH_REASON_LENGTH)


async def test_stop_after_grace_cancels_generation() -> None:
    engine = FakeEngine(step_s=0.01)
    worker = await serve(engine, shutdown_grace_s=0.1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        session = Session(worker_pb2_grpc.WorkerStub(channel))
        await session.call.write(start_frame(PROMPT, max_tokens=60))
        await session.read()
        await worker.stop()
        with pytest.raises(grpc.aio.AioRpcError):
            await session.turn_rest()
    steps = engine.steps
    await asyncio.sleep(0.1)  # the step in flight at the cancel may still end; nothing after it
    assert engine.steps <= steps + 1
    steps = engine.steps
    await asyncio.sleep(0.1)
    assert engine.steps == steps < 60  # the engine loop stopped with the worker
    assert worker.runner.counters.snapshot().sequences_cancelled_total == 1


def _numbered(sequences: list[int], at_most: int) -> bool:
    """Frames numbered 0, 1, ... without gaps: at least a token frame and the final, at most one per token."""
    return 2 <= len(sequences) <= at_most and sequences == list(range(len(sequences)))


async def _mux_stream(
    stub: worker_pb2_grpc.WorkerStub, *requests: worker_pb2.WorkerRequest
) -> list[worker_pb2.MuxDown]:
    """Over the worker's stream port (the port its load report announces), in one message: stream 1
    opened with ``requests[0]``, the rest behind it, then its half-close. Returns stream 1's frames
    up to its end."""
    port = (await stats(stub)).stream_port
    assert port
    opened = worker_pb2.MuxOpen(request_id="mux-1", tenant="acme")
    ups = [worker_pb2.MuxUp(stream=1, open=opened, request=requests[0])]
    ups += [worker_pb2.MuxUp(stream=1, request=r) for r in requests[1:]]
    ups.append(worker_pb2.MuxUp(stream=1, half_close=True))
    call = StreamConnection(("127.0.0.1", port), DEFAULT_INTERNAL_TOKEN, MAX_MESSAGE_BYTES)
    await call.write(worker_pb2.MuxRequest(frames=ups))
    frames: list[worker_pb2.MuxDown] = []
    messages = aiter(call)
    try:
        while not (frames and frames[-1].HasField("end")):
            message = await asyncio.wait_for(anext(messages), 10)
            frames += [f for f in message.frames if f.stream == 1]
    finally:
        call.cancel()
    return frames


def _finals(frames: list[worker_pb2.MuxDown]) -> list[worker_pb2.WorkerFinal]:
    return [f.response.final for f in frames if f.HasField("response") and f.response.HasField("final")]


async def test_a_mux_stream_runs_its_opening_start_then_the_turns_behind_it(harness: Any) -> None:
    engine, stub = harness
    frames = await _mux_stream(stub, start_frame(PROMPT, max_tokens=3), start_frame(PROMPT, max_tokens=2))
    assert frames[-1].end.code == 0
    assert [f.completion_tokens for f in _finals(frames)] == [3, 2]  # both turns, in order
    assert [prompt for prompt, _ in engine.started[-2:]] == [PROMPT, PROMPT]


async def test_a_cancel_right_behind_a_mux_streams_opening_start_cancels_that_turn(harness: Any) -> None:
    _, stub = harness
    frames = await _mux_stream(stub, start_frame(PROMPT, max_tokens=60), CANCEL)
    (final,) = _finals(frames)
    assert final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert final.completion_tokens < 60


async def test_stats_announce_the_build_model_id_and_version_then_the_engines_own() -> None:
    engine = FakeEngine()
    engine._info = dataclasses.replace(engine.info, build="fake-int4/rows>=2")
    worker = await serve(engine, model_version="v7")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            reply = await stats(worker_pb2_grpc.WorkerStub(channel))
        assert reply.build == "fake-model@v7/fake-int4/rows>=2"
    finally:
        await worker.stop()


async def test_an_engine_without_a_build_announces_none(harness: Any) -> None:
    _, stub = harness
    assert (await stats(stub)).build == ""  # the router then takes the tier for the build


@pytest.mark.parametrize("harness", [{"fault_first_token_delay_s": 0.3}], indirect=True)
async def test_the_injected_first_token_delay_holds_back_the_first_frame_only(harness: Any) -> None:
    """The fault-injection knob (off by default) delays the turn's first frame; the answer is unchanged."""
    assert load_settings(WorkerSettings).fault_first_token_delay_s == 0.0
    _, stub = harness
    began = time.perf_counter()
    result = await generate(stub, PROMPT, max_tokens=3)
    assert time.perf_counter() - began >= 0.3
    assert (result.text, result.reason) == ("hello worldhello", pb.FINISH_REASON_LENGTH)
