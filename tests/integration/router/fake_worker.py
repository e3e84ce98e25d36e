"""A fake Worker servicer for router tests: deterministic token ids, records calls, honours cancel.
The router reaches it as it reaches real workers, over the stream transport (the worker runtime's
own listener and serve_mux run its Generate per stream).

Tokens for a deterministic request (temperature 0 or a seed) depend only on the prompt, the seed
and the position, so a cached answer can be compared with a fresh one.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from services.common.config import ServiceSettings
from services.common.errors import MeshError, Unavailable
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.serving import MAX_MESSAGE_BYTES, RunningServer, start_server
from services.worker.mux import MuxCalls
from services.worker.mux_tcp import StreamMuxServer

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


@dataclass
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    worker_id: str
    tier: int
    token_delay_s: float = 0.0
    starts: list[worker_pb2.WorkerStart] = field(default_factory=list)
    start_calls: list[int] = field(default_factory=list)  # which call (stream) each start came on
    calls: int = 0  # streams (Generate runs)
    cancels: int = 0  # WorkerCancel messages received
    aborted: int = 0  # calls cancelled by the router while open
    fail_next: MeshError | None = None  # next stream: fails with this at once
    die_after_tokens: int | None = None  # next stream: abort with UNAVAILABLE after this many tokens
    stall_after_tokens: int | None = None  # next stream: go silent (until cancelled) after this many
    queued_for_s: float = 0.0  # each turn first "waits for a slot" this long, sending queued keepalives
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    server: RunningServer | None = None
    kv_used_bytes: int = 0  # reported in Stats (the load report)
    kv_budget_bytes: int = 0
    stats_delay_s: float = 0.0  # Stats answers this late (a busy worker)
    weights: int = 0  # which model it runs: workers of other weights answer other deterministic tokens
    stream: StreamMuxServer | None = None  # its stream transport (start_fake(stream=False): none)
    stream_port: int = 0  # announced in Stats: the stream's port, or (tests) a port that does not serve it
    model: str = ""  # the model id and build reported in Stats (a router with a models file routes by them)
    model_version: str = ""
    model_state: int = worker_pb2.MODEL_STATE_AWAKE  # reported in Stats; Sleep and Wake change it
    wake_gate: asyncio.Event | None = None  # Wake waits for it (a slow load) when set
    wake_error: MeshError | None = None  # Wake fails with this (the worker stays asleep)
    wake_calls: int = 0
    wake_started: asyncio.Event = field(default_factory=asyncio.Event)
    wake_cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # a caller went away mid-load
    sleep_calls: int = 0
    slept: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    def tokens(self, start: worker_pb2.WorkerStart) -> list[int]:
        """The turn's tokens; a resumed start continues at position len(resume_token_ids)."""
        s = start.sampling
        done = len(start.resume_token_ids)
        n = max(0, s.max_tokens - done)
        if s.temperature == 0 or s.HasField("seed"):
            base = sum(start.prompt_token_ids) * 31 + (s.seed if s.HasField("seed") else 0) + 500 * self.weights
            return [3 + (base + 7 * i) % 1000 for i in range(done, done + n)]
        return [random.randrange(3, 1003) for _ in range(n)]

    async def Generate(
        self, request_iterator: AsyncIterator[worker_pb2.WorkerRequest]
    ) -> AsyncIterator[worker_pb2.WorkerResponse]:
        """One stream's turns, served over the stream transport (serve_mux runs it per stream)."""
        self.calls += 1
        call_no = self.calls
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        starts: asyncio.Queue[worker_pb2.WorkerStart | None] = asyncio.Queue()
        cancel_turn = asyncio.Event()

        async def read() -> None:
            async for req in request_iterator:
                if req.HasField("start"):
                    starts.put_nowait(req.start)
                else:
                    self.cancels += 1
                    self.cancelled.set()
                    cancel_turn.set()
            starts.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (start := await starts.get()) is not None:
                self.starts.append(start)
                self.start_calls.append(call_no)
                cancel_turn.clear()
                finish = inference_pb2.FINISH_REASON_LENGTH
                produced = 0
                die_after, self.die_after_tokens = self.die_after_tokens, None
                stall_after, self.stall_after_tokens = self.stall_after_tokens, None
                waited = 0.0
                while waited < self.queued_for_s:  # like the worker runtime while its slots are busy
                    await asyncio.sleep(0.1)
                    waited += 0.1
                    yield worker_pb2.WorkerResponse(queued=True)
                for seq, tok in enumerate(self.tokens(start)):
                    if die_after is not None and seq == die_after:
                        raise Unavailable("fake crash mid-stream")
                    if stall_after is not None and seq == stall_after:
                        await asyncio.Event().wait()  # hung: only the router's stall timeout ends this
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)  # simulated decode step
                    if cancel_turn.is_set():
                        finish = inference_pb2.FINISH_REASON_CANCELLED
                        break
                    produced += 1
                    yield worker_pb2.WorkerResponse(sequence=seq, token_ids=[tok], text=f" t{tok}")
                yield worker_pb2.WorkerResponse(
                    sequence=produced,
                    final=worker_pb2.WorkerFinal(
                        finish_reason=finish,
                        prompt_tokens=len(start.prompt_token_ids),
                        completion_tokens=produced,
                        prefill_tokens=len(start.prompt_token_ids),
                    ),
                )
        except asyncio.CancelledError:
            self.aborted += 1
            self.cancelled.set()
            raise
        finally:
            reader.cancel()

    async def crash(self) -> None:
        """Go away at once without telling anyone, as a killed process does: the gRPC server and the
        stream transport stop, every connection and call on them ends mid-stream."""
        assert self.server is not None
        await self.server.server.stop(None)
        if self.stream is not None:
            self.stream.close(0.0)
            await self.stream.finish()

    async def Sleep(
        self, request: worker_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ModelStateReply:
        self.sleep_calls += 1
        self.model_state = worker_pb2.MODEL_STATE_ASLEEP
        self.slept.set()
        return worker_pb2.ModelStateReply(model_state=self.model_state)

    async def Wake(
        self, request: worker_pb2.WakeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ModelStateReply:
        self.wake_calls += 1
        self.wake_started.set()
        self.model_state = worker_pb2.MODEL_STATE_WAKING
        try:
            if self.wake_gate is not None:
                await self.wake_gate.wait()
        except asyncio.CancelledError:
            self.model_state = worker_pb2.MODEL_STATE_ASLEEP  # every caller left: back to sleep
            self.wake_cancelled.set()
            raise
        if self.wake_error is not None:
            self.model_state = worker_pb2.MODEL_STATE_ASLEEP
            raise self.wake_error
        self.model_state = worker_pb2.MODEL_STATE_AWAKE
        return worker_pb2.ModelStateReply(model_state=self.model_state)

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        if self.stats_delay_s:
            await asyncio.sleep(self.stats_delay_s)
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id,
            tier=self.tier,  # type: ignore[arg-type]
            sequences_started_total=len(self.starts),
            sequences_cancelled_total=self.cancels + self.aborted,
            kv_used_bytes=self.kv_used_bytes,
            kv_budget_bytes=self.kv_budget_bytes,
            stream_port=self.stream_port,
            model=self.model,
            model_version=self.model_version,
            model_state=self.model_state,  # type: ignore[arg-type]
        )


async def start_fake(
    worker_id: str,
    tier: int,
    token: str,
    cls: type[FakeWorker] | None = None,
    stream: bool = True,
    **kwargs: object,
) -> FakeWorker:
    """A fake worker on a real gRPC server (Stats, health) serving the stream transport, as real
    workers do; ``stream=False``: a worker that announces no stream port."""
    fake = (cls or FakeWorker)(worker_id, tier, **kwargs)  # type: ignore[arg-type]
    fake.server = await start_server(
        ServiceSettings(port=0, internal_token=token, shutdown_grace_s=0),
        lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(fake, s),
        [WORKER_SERVICE],
        internal=True,
    )
    if stream:
        fake.stream = StreamMuxServer(fake.Generate, MuxCalls(), token, MAX_MESSAGE_BYTES)
        await fake.stream.start("127.0.0.1", 0)
        fake.stream_port = fake.stream.port
        fake.server.on_stop.append(fake.stream.finish)
    return fake
