"""serve_mux: Generate streams multiplexed on one call, driven directly (no network) with a fake Generate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.worker.mux import MuxCalls, serve_mux

OK = 0


def _start(n: int) -> worker_pb2.WorkerRequest:
    return worker_pb2.WorkerRequest(start=worker_pb2.WorkerStart(prompt_token_ids=[n]))


class FakeGenerate:
    """Per start: ``n`` token frames then a final frame (n = the start's first prompt id); special n's fail."""

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.started = asyncio.Event()

    async def __call__(
        self, requests: AsyncIterator[worker_pb2.WorkerRequest]
    ) -> AsyncIterator[worker_pb2.WorkerResponse]:
        try:
            async for req in requests:
                n = req.start.prompt_token_ids[0]
                self.started.set()
                if n == 100:
                    raise InvalidArgument("the prompt is too long for this worker")
                if n == 101:
                    raise ResourceExhausted("the worker queue is full", retry_after_ms=250)
                if n == 102:
                    raise Unavailable("fake crash")
                if n == 103:
                    await asyncio.Event().wait()  # runs until aborted or out of time
                for i in range(n):
                    yield worker_pb2.WorkerResponse(sequence=i, token_ids=[n * 10 + i])
                    await asyncio.sleep(0)
                yield worker_pb2.WorkerResponse(sequence=n, final=worker_pb2.WorkerFinal(completion_tokens=n))
        finally:
            self.closed.append(structlog.contextvars.get_contextvars()["request_id"])  # the stream's own


class Router:
    """The router's end of one call: queue MuxUp frames, collect MuxDown frames by stream."""

    def __init__(self, generate: FakeGenerate, max_streams: int = 4096, calls: MuxCalls | None = None) -> None:
        self.up: asyncio.Queue[worker_pb2.MuxRequest | None] = asyncio.Queue()
        self.frames: dict[int, list[worker_pb2.MuxDown]] = {}
        self.messages = 0
        served = serve_mux(generate, self._requests(), max_streams=max_streams, calls=calls)
        self._task = asyncio.create_task(self._collect(served))

    async def _requests(self) -> AsyncIterator[worker_pb2.MuxRequest]:
        while (msg := await self.up.get()) is not None:
            yield msg

    async def _collect(self, out: AsyncIterator[worker_pb2.MuxResponse]) -> None:
        async for message in out:
            self.messages += 1
            for down in message.frames:
                self.frames.setdefault(down.stream, []).append(down)

    def send(self, *frames: worker_pb2.MuxUp) -> None:
        self.up.put_nowait(worker_pb2.MuxRequest(frames=frames))

    def open(self, sid: int, request: worker_pb2.WorkerRequest, timeout_ms: int = 0) -> None:
        opened = worker_pb2.MuxOpen(request_id=f"req-{sid}", tenant="acme", timeout_ms=timeout_ms)
        self.send(worker_pb2.MuxUp(stream=sid, open=opened, request=request))

    async def ended(self, sid: int) -> worker_pb2.MuxEnd:
        for _ in range(500):
            frames = self.frames.get(sid, [])
            if frames and frames[-1].HasField("end"):
                return frames[-1].end
            await asyncio.sleep(0.01)
        raise AssertionError(f"stream {sid} never ended")

    async def close(self) -> None:
        self.up.put_nowait(None)
        await asyncio.wait_for(self._task, 5)


async def test_streams_interleave_on_one_call_each_in_order_with_its_own_end() -> None:
    gen = FakeGenerate()
    router = Router(gen)
    router.open(1, _start(5))
    router.open(2, _start(3))
    router.send(worker_pb2.MuxUp(stream=1, half_close=True), worker_pb2.MuxUp(stream=2, half_close=True))
    assert (await router.ended(1)).code == OK and (await router.ended(2)).code == OK
    for sid, n in ((1, 5), (2, 3)):
        responses = [f.response for f in router.frames[sid][:-1]]
        assert [t for r in responses for t in r.token_ids] == [n * 10 + i for i in range(n)]
        assert responses[-1].final.completion_tokens == n
    assert sorted(gen.closed) == ["req-1", "req-2"]  # each stream ran with its own request id
    await router.close()
    assert router.messages < 5 + 3 + 2 * 2  # frames ready together left as one message


async def test_a_stream_takes_turns_until_half_closed() -> None:
    router = Router(FakeGenerate())
    router.open(7, _start(2))
    router.send(worker_pb2.MuxUp(stream=7, request=_start(1)), worker_pb2.MuxUp(stream=7, half_close=True))
    assert (await router.ended(7)).code == OK
    finals = [f.response for f in router.frames[7] if f.HasField("response") and f.response.HasField("final")]
    assert [f.final.completion_tokens for f in finals] == [2, 1]
    await router.close()


async def test_errors_end_their_stream_with_the_calls_status_and_leave_others_running() -> None:
    router = Router(FakeGenerate())
    router.open(1, _start(100))
    router.open(2, _start(101))
    router.open(3, _start(102))
    router.open(4, _start(2))
    invalid, exhausted, aborted = await router.ended(1), await router.ended(2), await router.ended(3)
    assert (invalid.code, invalid.message) == (
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        "the prompt is too long for this worker",
    )
    assert (exhausted.code, exhausted.retry_after_ms) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], 250)
    assert (aborted.code, aborted.message) == (grpc.StatusCode.UNAVAILABLE.value[0], "fake crash")
    router.send(worker_pb2.MuxUp(stream=4, half_close=True))
    assert (await router.ended(4)).code == OK
    await router.close()


async def test_abort_cancels_the_stream_at_once_and_its_deadline_ends_it() -> None:
    gen = FakeGenerate()
    router = Router(gen)
    router.open(1, _start(103))
    await asyncio.wait_for(gen.started.wait(), 5)
    router.send(worker_pb2.MuxUp(stream=1, abort=True))
    for _ in range(500):
        if "req-1" in gen.closed:
            break
        await asyncio.sleep(0.01)
    assert gen.closed == ["req-1"]
    assert 1 not in router.frames  # aborted by the router: nobody waits for an end frame
    router.open(2, _start(103), timeout_ms=50)
    assert (await router.ended(2)).code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    await router.close()


async def test_streams_beyond_the_limit_and_reused_ids_are_refused() -> None:
    router = Router(FakeGenerate(), max_streams=1)
    router.open(1, _start(103))
    router.open(2, _start(1))
    busy = await router.ended(2)
    assert busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and busy.retry_after_ms > 0
    router.open(1, _start(1))
    assert (await router.ended(1)).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    router.send(worker_pb2.MuxUp(stream=1, abort=True))  # else the call stays open while stream 1 runs
    await router.close()


async def test_the_calls_end_cancels_every_stream() -> None:
    gen = FakeGenerate()
    router = Router(gen)
    router.open(1, _start(103))
    router.open(2, _start(103))
    for _ in range(500):
        if gen.started.is_set():
            break
        await asyncio.sleep(0.01)
    router._task.cancel()  # the router went away
    for _ in range(500):
        if len(gen.closed) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(gen.closed) == ["req-1", "req-2"]


async def test_a_drain_refuses_new_streams_and_ends_the_call_after_the_running_ones() -> None:
    calls = MuxCalls()
    gen = FakeGenerate()
    router = Router(gen, calls=calls)
    router.open(1, _start(103))  # runs until aborted
    await asyncio.wait_for(gen.started.wait(), 5)
    calls.drain()
    router.open(2, _start(1))
    refused = await router.ended(2)
    assert refused.code == grpc.StatusCode.UNAVAILABLE.value[0] and "shutting down" in refused.message
    assert not router._task.done()  # stream 1 still runs: the call stays
    router.send(worker_pb2.MuxUp(stream=1, abort=True))
    await asyncio.wait_for(router._task, 5)  # its last stream ended: the call ends without the router closing it


async def test_a_stream_sending_too_far_ahead_is_ended_and_others_run_on() -> None:
    from services.worker.mux import MAX_UNREAD

    gen = FakeGenerate()
    router = Router(gen)
    router.open(1, _start(103))  # its handler runs and reads nothing more
    await asyncio.wait_for(gen.started.wait(), 5)
    router.send(*(worker_pb2.MuxUp(stream=1, request=_start(1)) for _ in range(MAX_UNREAD + 10)))
    router.open(2, _start(2))
    end = await router.ended(1)
    assert end.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "frames sent ahead" in end.message
    router.send(worker_pb2.MuxUp(stream=2, half_close=True))
    assert (await router.ended(2)).code == OK
    await router.close()


async def test_the_routers_host_flags_reach_the_engine_as_the_latest_deadline_and_leave_with_their_call() -> None:
    holds: list[float] = []
    calls = MuxCalls(hold=holds.append)
    one, two = Router(FakeGenerate(), calls=calls), Router(FakeGenerate(), calls=calls)

    async def flag(router: Router, ttl_ms: int) -> None:
        count = len(holds)
        router.up.put_nowait(worker_pb2.MuxRequest(background_hold=worker_pb2.BackgroundHold(ttl_ms=ttl_ms)))
        for _ in range(500):
            if len(holds) > count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the flag never reached the engine")

    before = time.monotonic()
    await flag(one, 1000)
    assert before + 1.0 <= holds[-1] <= time.monotonic() + 1.0
    await flag(two, 60_000)
    assert holds[-1] >= before + 60  # the latest of the routers' flags
    await flag(two, 0)
    assert holds[-1] < before + 60  # back to router one's
    await two.close()
    await one.close()  # the call ended: its flag goes with it
    assert holds[-1] == 0.0
