"""Client-side helpers for tests of the workers' gRPC API (unit tests with fakes and integration)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.generation import Final, FinishReason, GenerationEvent
from services.common.logprobs import TokenLogprob
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2

META = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN), ("x-request-id", "test"))


def start_frame(prompt: Sequence[int], **sampling: object) -> worker_pb2.WorkerRequest:
    params = inference_pb2.SamplingParams(**sampling)  # type: ignore[arg-type]
    return worker_pb2.WorkerRequest(start=worker_pb2.WorkerStart(prompt_token_ids=list(prompt), sampling=params))


CANCEL = worker_pb2.WorkerRequest(cancel=worker_pb2.WorkerCancel())


@dataclass
class TurnResult:
    """Frames of one turn, folded."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sequences: list[int] = field(default_factory=list)
    final: worker_pb2.WorkerFinal | None = None
    queued: int = 0
    """Keepalives received while the turn waited for a slot (not part of the numbered frames)."""

    @property
    def reason(self) -> int:
        assert self.final is not None
        return self.final.finish_reason


def fold(frames: Sequence[worker_pb2.WorkerResponse]) -> TurnResult:
    result = TurnResult()
    for frame in frames:
        if frame.queued:
            result.queued += 1
            continue
        result.token_ids.extend(frame.token_ids)
        result.text += frame.text
        result.sequences.append(frame.sequence)
        if frame.HasField("final"):
            result.final = frame.final
    return result


async def generate(stub: worker_pb2_grpc.WorkerStub, prompt: Sequence[int], **sampling: object) -> TurnResult:
    """One turn on its own stream (start, then half-close)."""

    async def requests() -> AsyncIterator[worker_pb2.WorkerRequest]:
        yield start_frame(prompt, **sampling)

    return fold([frame async for frame in stub.Generate(requests(), metadata=META)])


class Session:
    """A bidirectional stream driven step by step (write frames, read frames)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.call = stub.Generate(metadata=META)

    async def turn(self, prompt: Sequence[int], **sampling: object) -> TurnResult:
        await self.call.write(start_frame(prompt, **sampling))
        return await self.turn_rest()

    async def turn_rest(self) -> TurnResult:
        """Read frames up to and including the turn's final frame."""
        frames = []
        while True:
            frame = await self.call.read()
            assert frame is not grpc.aio.EOF
            frames.append(frame)
            if frame.HasField("final"):
                return fold(frames)

    async def read(self) -> worker_pb2.WorkerResponse:
        frame = await self.call.read()
        assert frame is not grpc.aio.EOF
        return frame


async def stats(stub: worker_pb2_grpc.WorkerStub) -> worker_pb2.WorkerStats:
    return await stub.Stats(worker_pb2.StatsRequest(), metadata=META)


async def wait_idle(stub: worker_pb2_grpc.WorkerStub, timeout_s: float = 10.0) -> worker_pb2.WorkerStats:
    """Poll Stats until no sequence is active (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        current = await stats(stub)
        if current.active_sequences == 0 and current.queue_depth == 0:
            return current
        assert asyncio.get_running_loop().time() < deadline, f"worker still busy: {current}"
        await asyncio.sleep(0.02)  # polling a condition, not readiness


async def cancel_during_prefill(
    stub: worker_pb2_grpc.WorkerStub, prompt: Sequence[int], prefilling: Callable[[], bool], timeout_s: float = 60.0
) -> tuple[Session, worker_pb2.WorkerFinal]:
    """Start a turn over ``prompt``, cancel it once ``prefilling()`` (the engine's own counter moved),
    and return the stream and the turn's final frame (the stream stays open for another turn)."""
    session = Session(stub)
    await session.call.write(start_frame(prompt, max_tokens=5))
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not prefilling():
        assert asyncio.get_running_loop().time() < deadline, "the prefill never started"
        await asyncio.sleep(0.01)  # polling a condition, not readiness
    await session.call.write(CANCEL)
    final = (await session.turn_rest()).final
    assert final is not None
    return session, final


async def wait_serving(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 30.0) -> None:
    """Block until gRPC health reports SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=service)
    async for response in stub.Watch(request, timeout=timeout_s):
        if response.status == health_pb2.HealthCheckResponse.SERVING:
            return


def worker_frame(
    sequence: int,
    token_ids: Sequence[int],
    text: str = "",
    *,
    final: Final | None = None,
    index: int = 0,
    logprobs: Sequence[TokenLogprob] = (),
) -> GenerationEvent:
    """A frame a worker stream reads back (what the stream transport builds from a WorkerResponse)."""
    return GenerationEvent(tuple(token_ids), text, index, tuple(logprobs), final=final, sequence=sequence)


def worker_final(reason: int, prompt_tokens: int, completion_tokens: int, prefill_tokens: int) -> Final:
    return Final(FinishReason(reason), prompt_tokens, completion_tokens, prefill_tokens)
