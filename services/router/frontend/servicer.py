"""meshserve.v1.Inference as served by the router over gRPC (the split layout): protos in, calls of the
transport-free :class:`~services.router.frontend.api.RouterAPI`, protos out. Nothing else happens here: the
request id and tenant come from the call's metadata (bound by the interceptors), the deadline from
the call, and the frames are merged while the writer is behind, then numbered as they go out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc
import structlog

from services.common import logprobs_pb
from services.common.coalesce import FlushWindow, coalesced
from services.common.errors import MeshError
from services.common.pb.meshserve.v1 import inference_pb2, inference_pb2_grpc
from services.router.frontend import convert
from services.router.frontend.api import ChatSession, RouterAPI
from services.router.frontend.observe import observe_refusal
from services.router.types import Chunk, Done, Event, TurnEvent, is_done, merge


def _call_context(context: grpc.aio.ServicerContext) -> tuple[str, str, float | None]:
    """(request id, tenant, deadline) of the call."""
    ctx = structlog.contextvars.get_contextvars()
    remaining = context.time_remaining()
    deadline = time.monotonic() + remaining if remaining is not None and remaining < 1e9 else None
    return str(ctx.get("request_id", "")), str(ctx.get("tenant", "")), deadline


class RouterServicer(inference_pb2_grpc.InferenceServicer):
    """The router's ``meshserve.v1.Inference`` service over :class:`RouterAPI`."""

    def __init__(self, api: RouterAPI, *, flush: FlushWindow | None = None) -> None:
        self._api = api
        self._flush = flush  # spaces a stream's frames while many streams are open (None: off)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        request_id, tenant, deadline = _call_context(context)
        with observe_refusal():
            generation = convert.generation(request, tenant=tenant, request_id=request_id)
        events = coalesced(self._api.generate(generation, deadline=deadline), merge, window=self._flush, urgent=is_done)
        seq = 0
        async with aclosing(events):
            async for event in events:
                if isinstance(event, Chunk):
                    yield inference_pb2.GenerateResponse(
                        request_id=request_id,
                        sequence=seq,
                        token_ids=event.token_ids,
                        text=event.text,
                        index=event.index,
                        logprobs=logprobs_pb.to_pb(event.logprobs),
                    )
                else:
                    yield inference_pb2.GenerateResponse(
                        request_id=request_id, sequence=seq, final=convert.done_pb(event), index=event.index
                    )
                seq += 1

    async def Complete(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        request_id, tenant, deadline = _call_context(context)
        with observe_refusal():
            generation = convert.generation(request, tenant=tenant, request_id=request_id)
        chunk, done = await self._api.complete(generation, deadline=deadline)
        return inference_pb2.GenerateResponse(
            request_id=request_id,
            token_ids=chunk.token_ids,
            text=chunk.text,
            final=convert.done_pb(done),
            logprobs=logprobs_pb.to_pb(chunk.logprobs),
        )

    async def Chat(
        self, request_iterator: AsyncIterator[inference_pb2.ChatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.ChatResponse]:
        request_id, tenant, deadline = _call_context(context)
        session = self._api.chat(tenant=tenant, request_id=request_id, deadline=deadline)
        reader = asyncio.create_task(_read_client(request_iterator, session), name="chat-client-reader")
        try:
            async with aclosing(session.events()) as chat:
                while (first := await anext(chat, None)) is not None:
                    # Coalesced turn by turn: a chat between turns is no open stream to the flush window.
                    turn = first.turn
                    events = coalesced(_one_turn(first, chat), merge, window=self._flush, urgent=is_done)
                    seq = 0
                    async with aclosing(events):
                        async for event in events:
                            if isinstance(event, Chunk):
                                frame = inference_pb2.ChatResponse(
                                    turn=turn,
                                    sequence=seq,
                                    token_ids=event.token_ids,
                                    text=event.text,
                                    tool_calls=convert.tool_calls_pb(event.tool_calls),
                                    index=event.index,
                                    logprobs=logprobs_pb.to_pb(event.logprobs),
                                )
                            else:
                                frame = inference_pb2.ChatResponse(
                                    turn=turn, sequence=seq, final=convert.done_pb(event), index=event.index
                                )
                            frame.request_id = request_id
                            yield frame
                            seq += 1
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        return convert.models_pb(await self._api.list_models())

    async def Embed(
        self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EmbedResponse:
        request_id, tenant, deadline = _call_context(context)
        query = convert.embed_query(request, tenant=tenant, request_id=request_id)
        return convert.embeddings_pb(await self._api.embed(query, deadline=deadline), request_id)


async def _one_turn(first: TurnEvent, chat: AsyncIterator[TurnEvent]) -> AsyncGenerator[Event, None]:
    """The events of the turn that ``first`` starts, read from ``chat`` up to its last Done."""
    yield first.event
    if isinstance(first.event, Done) and first.event.last:
        return
    async for item in chat:
        yield item.event
        if isinstance(item.event, Done) and item.event.last:
            return


async def _read_client(request_iterator: AsyncIterator[inference_pb2.ChatRequest], session: ChatSession) -> None:
    """The client's frames into the session: turns, cancels, the end (a turn it cannot convert fails
    the session where that turn would have been served)."""
    try:
        async for msg in request_iterator:
            if msg.HasField("cancel"):
                await session.cancel_turn()
            elif msg.HasField("turn"):
                try:
                    turn = convert.chat_turn(msg.turn)
                except MeshError as exc:
                    session.fail(exc)
                    return
                if not await session.send(turn):
                    return  # further frames wait in gRPC's flow control
    finally:
        await session.end()
