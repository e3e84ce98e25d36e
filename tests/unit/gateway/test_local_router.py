"""LocalRouter: the InferenceStub surface over an in-process servicer (a fake one here)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.errors import NotFound, Unavailable
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.local_router import LocalRouter


class FakeServicer:
    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.time_remaining: float | None = None
        self.chat_seen: list[str] = []

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        self.time_remaining = context.time_remaining()
        if request.model == "missing":
            raise NotFound("unknown model 'missing'")
        try:
            for i in range(1000):
                yield pb.GenerateResponse(sequence=i, token_ids=[i])
                await asyncio.sleep(0)
        finally:
            self.closed.set()

    async def Complete(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        return pb.GenerateResponse(text=request.prompt.upper())

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="m")])

    async def Chat(self, requests, context) -> AsyncIterator[pb.ChatResponse]:
        async for msg in requests:
            self.chat_seen.append(msg.turn.messages[0].content)
            yield pb.ChatResponse(text=msg.turn.messages[0].content)


def _turn(text: str) -> pb.ChatRequest:
    return pb.ChatRequest(turn=pb.ChatTurn(messages=[pb.ChatMessage(role="user", content=text)]))


async def test_calls_before_the_router_is_set_are_unavailable() -> None:
    with pytest.raises(Unavailable):
        LocalRouter().Generate(pb.GenerateRequest(prompt="x"))


async def test_unary_calls_and_the_deadline_reach_the_servicer() -> None:
    fake = FakeServicer()
    router = LocalRouter(fake)  # type: ignore[arg-type]
    assert (await router.Complete(pb.GenerateRequest(prompt="abc"))).text == "ABC"
    assert (await router.ListModels(pb.ListModelsRequest())).models[0].id == "m"
    frames = router.Generate(pb.GenerateRequest(prompt="x"), timeout=30.0)
    assert (await anext(aiter(frames))).token_ids == [0]
    assert fake.time_remaining is not None and 29.0 < fake.time_remaining <= 30.0
    await frames.aclose()
    assert fake.closed.is_set()


async def test_domain_errors_come_through_as_they_are() -> None:
    call = LocalRouter(FakeServicer()).Generate(pb.GenerateRequest(prompt="x", model="missing"))  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="missing"):
        async for _ in call:
            pass


async def test_cancel_between_frames_closes_the_routers_generator() -> None:
    fake = FakeServicer()
    call = LocalRouter(fake).Generate(pb.GenerateRequest(prompt="x"))  # type: ignore[arg-type]
    frames = aiter(call)
    await anext(frames)
    assert call.cancel()
    await asyncio.wait_for(fake.closed.wait(), 5)
    assert not call.cancel()  # ended: nothing left to do


async def test_chat_writes_reach_the_servicer_in_order_and_done_writing_ends_it() -> None:
    fake = FakeServicer()
    call = LocalRouter(fake).Chat(timeout=10)  # type: ignore[arg-type]
    await call.write(_turn("one"))
    await call.write(_turn("two"))
    await call.done_writing()
    replies = [r.text async for r in call]
    assert replies == ["one", "two"] and fake.chat_seen == ["one", "two"]


async def test_chat_writes_wait_while_the_router_does_not_read() -> None:
    fake = FakeServicer()
    call = LocalRouter(fake).Chat(timeout=10)  # type: ignore[arg-type]
    for i in range(16):  # the buffer: what a client may write ahead of the router
        await call.write(_turn(str(i)))
    blocked = asyncio.create_task(call.write(_turn("16")))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not blocked.done()  # nothing read: the 17th write waits instead of growing the buffer
    frames = aiter(call)
    assert (await anext(frames)).text == "0"  # the router reads: the write goes through
    await asyncio.wait_for(blocked, 5)
    assert call.cancel()
