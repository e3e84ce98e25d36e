"""A router in another process (the split layout, ``meshserve up --split-router``), reached over gRPC
with the surface of the router's own API (:class:`~services.router.types.InferenceRouter`): the
gateway's servicer has one path for both layouts.

Domain requests go out as protos, frames come back as events (their request id and sequence number
are dropped: the gateway numbers its own frames), and a failed call becomes the domain error the
caller sees (:func:`~services.common.status_errors.from_rpc_error`). The call's metadata carries the
internal token, the key id, and the request id, tenant and trace of the current context. A remote
router cannot be held back until a pending admission is decided, so the caller is admitted first
(``overlaps_admission`` is False) and a pending admission passed in is waited for before the call.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator

import grpc
import structlog

from services.common import logprobs_pb
from services.common import metadata as md
from services.common.interceptors import outbound_metadata
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.status_errors import Upstream, from_rpc_error
from services.router.frontend import convert
from services.router.types import (
    ChatTurn,
    Chunk,
    Done,
    Embeddings,
    EmbedQuery,
    Event,
    Generation,
    ModelInfo,
    PendingAdmission,
    TurnEvent,
    admitted,
)

# A call that ended (its status is what the reader reports) refuses writes with one of these.
_CALL_ENDED = (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError)


def _timeout(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class RemoteRouter:
    """The router's API over its ``meshserve.v1.Inference`` service (see the module docstring)."""

    overlaps_admission = False

    def __init__(self, stub: inference_pb2_grpc.InferenceStub, internal_token: str) -> None:
        self._stub = stub
        self._token = internal_token

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        key_id = str(structlog.contextvars.get_contextvars().get("key_id", ""))
        return outbound_metadata(self._token, **({md.KEY_ID: key_id} if key_id else {}))

    async def generate(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> AsyncGenerator[Event, None]:
        await admitted(admission)
        call = self._stub.Generate(
            convert.generation_pb(request), metadata=self._metadata(), timeout=_timeout(deadline)
        )
        finals = convert.FinalCounter(request.sampling.n)
        try:
            async for frame in call:
                yield convert.event(frame, finals.last(frame))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, Upstream.ROUTER) from None
        finally:
            call.cancel()

    async def complete(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> tuple[Chunk, Done]:
        await admitted(admission)
        call = self._stub.Complete(
            convert.generation_pb(request), metadata=self._metadata(), timeout=_timeout(deadline)
        )
        try:
            reply: pb.GenerateResponse = await call
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, Upstream.ROUTER) from None
        finally:
            call.cancel()
        done = convert.event(pb.GenerateResponse(final=reply.final))
        assert isinstance(done, Done)
        return Chunk(list(reply.token_ids), reply.text, logprobs=logprobs_pb.from_pb(reply.logprobs)), done

    async def list_models(self, *, deadline: float | None = None) -> list[ModelInfo]:
        call = self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata(), timeout=_timeout(deadline))
        try:
            reply: pb.ListModelsResponse = await call
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, Upstream.ROUTER) from None
        finally:
            call.cancel()
        return convert.models(reply)

    async def embed(self, query: EmbedQuery, *, deadline: float | None = None) -> Embeddings:
        call = self._stub.Embed(convert.embed_query_pb(query), metadata=self._metadata(), timeout=_timeout(deadline))
        try:
            reply: pb.EmbedResponse = await call
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, Upstream.ROUTER) from None
        finally:
            call.cancel()
        return convert.embeddings(reply)

    def chat(self, *, tenant: str = "", request_id: str = "", deadline: float | None = None) -> RemoteChat:
        """A Chat call (tenant and request id travel in the metadata, from the current context)."""
        return RemoteChat(self._stub.Chat(metadata=self._metadata(), timeout=_timeout(deadline)))


class RemoteChat:
    """One Chat call as a :class:`~services.router.types.ChatChannel`."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call
        self._choices: deque[int] = deque()  # n of each turn sent and not yet ended, in order

    async def send(self, turn: ChatTurn) -> bool:
        self._choices.append(turn.sampling.n)
        return await self._write(pb.ChatRequest(turn=convert.chat_turn_pb(turn)))

    async def cancel_turn(self) -> None:
        await self._write(pb.ChatRequest(cancel=pb.Cancel()))

    async def end(self) -> None:
        try:
            await self._call.done_writing()
        except _CALL_ENDED:
            pass  # the call ended: events() reports how

    async def _write(self, request: pb.ChatRequest) -> bool:
        try:
            await self._call.write(request)
        except _CALL_ENDED:
            return False  # the call ended: events() reports how
        return True

    async def events(self) -> AsyncGenerator[TurnEvent, None]:
        try:
            finals: convert.FinalCounter | None = None
            async for frame in self._call:
                if finals is None:
                    finals = convert.FinalCounter(self._choices.popleft() if self._choices else 1)
                last = finals.last(frame)
                if last and frame.HasField("final"):
                    finals = None  # the turn ended: the next frame starts the next turn
                yield TurnEvent(frame.turn, convert.event(frame, last))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, Upstream.ROUTER) from None
        finally:
            self._call.cancel()
