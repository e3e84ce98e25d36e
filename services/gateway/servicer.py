"""The public `meshserve.v1.Inference` service: authenticate, validate, then relay to the router.

The gateway never looks inside a response beyond metrics: it stamps its request id and relays.
Deadlines: the caller's (capped at ``max_deadline_s``; a Chat session at ``max_chat_deadline_s``) or a
default is set on the router call.
Cancellation: a caller cancel cancels the router call (``finally`` below); a router failure
becomes the matching domain error for the caller (:mod:`services.common.status_errors`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import grpc
import structlog

from services.common import metadata as md
from services.common import tracing
from services.common.coalesce import coalesced
from services.common.errors import DeadlineExceeded, MeshError
from services.common.interceptors import outbound_metadata
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.pending_admission import PENDING_ADMISSION, SPECULATIVE
from services.common.status_errors import Upstream, from_rpc_error
from services.gateway import scopes
from services.gateway.admission import Gate, Ticket
from services.gateway.config import GatewaySettings
from services.gateway.identity import Identity
from services.gateway.local_router import LocalRouter
from services.gateway.observe import observe
from services.gateway.validation import Limits, validate_chat_request, validate_generate

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_END = object()
_Frame = TypeVar("_Frame", pb.GenerateResponse, pb.ChatResponse)


def _merge(first: _Frame, then: _Frame) -> _Frame | None:
    """Two token frames that waited for the writer, as one (a final frame stays a frame of its own)."""
    if first.HasField("final") or then.HasField("final") or getattr(first, "turn", 0) != getattr(then, "turn", 0):
        return None
    first.token_ids.extend(then.token_ids)
    first.text += then.text
    return first


async def _after_the_worker_start(admit: Awaitable[Ticket]) -> Ticket:
    """A speculative start's reservation, begun one event-loop turn late: the router, which runs on
    without a pause, has queued the worker's start by then, so the start is written first and the
    Redis command right after it (docs/gateway.md, *Numbers*: ~0.1 ms less to the first token)."""
    await asyncio.sleep(0)
    return await admit


def _is_final(frame: _Frame) -> bool:
    return frame.HasField("final")


def _on_rpc_end(context: grpc.aio.ServicerContext, call: Any, settle: Callable[[], None]) -> None:
    """However the RPC ends, stop the router call and settle the request's tickets (both idempotent).

    The handler's own ``finally`` does both, but a handler (an async generator) that its RPC's
    cancellation leaves suspended at a ``yield`` runs its ``finally`` only once it is garbage
    collected, which can be much later: its stream slot would stay leased and the worker busy.
    """

    def ended(_context: object) -> None:
        call.cancel()
        settle()

    context.add_done_callback(ended)


class GatewayServicer(inference_pb2_grpc.InferenceServicer):
    """Relays the public API to the router after authentication and validation."""

    def __init__(
        self,
        settings: GatewaySettings,
        gate: Gate,
        router: inference_pb2_grpc.InferenceStub,
    ) -> None:
        self._settings = settings
        self._gate = gate
        self._router = router
        # Start routing while the reservation runs: only in place (a remote router cannot be held back).
        self._overlap_admission = isinstance(router, LocalRouter) and settings.overlap_admission
        self._flush = settings.flush_window()  # spaces a stream's frames while many are open
        self._limits = Limits(
            max_prompt_chars=settings.max_prompt_chars,
            max_tokens=settings.max_tokens_limit,
            max_stop_strings=settings.max_stop_strings,
            max_stop_chars=settings.max_stop_chars,
            max_chat_messages=settings.max_chat_messages,
            max_model_chars=settings.max_model_chars,
        )

    async def _admit(
        self, context: grpc.aio.ServicerContext, method: str, *, send_headers: bool = False
    ) -> tuple[str, Identity]:
        """Assign the request id, authenticate, check the method's scope, bind id + tenant + key id
        for logs and metadata.

        ``x-request-id`` goes back in the trailing metadata (with the status, on success and on
        every error after this point) and in every response message. Response headers carrying it
        are sent only with ``send_headers`` (Chat, whose clients wait for them before writing):
        a separate headers operation costs a unary call or a stream a sizeable share of the
        gateway's CPU (docs/benchmarks/hops.md), while the first message carries empty headers free.
        """
        request_id = uuid.uuid4().hex
        # Overwrite whatever the caller put in x-request-id / x-meshserve-tenant: nothing from a
        # public caller is trusted until its credential has resolved the tenant.
        structlog.contextvars.bind_contextvars(request_id=request_id, tenant="", key_id="")
        identity = await self._gate.identify(context.invocation_metadata() or ())
        structlog.contextvars.bind_contextvars(tenant=identity.tenant, key_id=identity.key_id)
        tracing.annotate({"meshserve.request_id": request_id, "meshserve.tenant": identity.tenant})
        scopes.require(method, identity.scopes, identity.key_id)
        context.set_trailing_metadata(((md.REQUEST_ID, request_id),))
        if send_headers:
            await context.send_initial_metadata(((md.REQUEST_ID, request_id),))
        return request_id, identity

    async def _reservation(
        self, identity: Identity, request: pb.GenerateRequest, stream_ttl_s: float | None
    ) -> asyncio.Future[Ticket]:
        """Validation, policy checks and the rate-limit reservation of a Generate/Complete request.

        Validation errors raise here. The reservation is awaited here too, unless the router is
        embedded (and the tenant was not refused lately): then it runs on while the router prepares
        the request (:mod:`services.common.pending_admission`: the caller gets nothing until it
        succeeds, and a worker gets work only then, except for the few requests per tenant
        :meth:`Gate.speculate` lets start at once). Either way the returned future holds the ticket,
        and :meth:`_settle_once_admitted` must be called with it when the request ends.
        """
        validate_generate(request, self._limits)
        policy = self._gate.policy(identity)
        request.routing.priority = min(request.routing.priority, policy.priority)
        prompts, max_tokens = [request.prompt], request.sampling.max_tokens
        admit = self._gate.admit(identity, policy, prompts, max_tokens, stream_ttl_s=stream_ttl_s)
        if not self._overlap_admission or self._gate.recently_refused(identity.tenant):
            done: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
            done.set_result(await admit)
            return done
        speculate = self._gate.speculate(identity.tenant)
        pending = asyncio.ensure_future(_after_the_worker_start(admit) if speculate else admit)
        PENDING_ADMISSION.set(pending)  # this call's task (and the tasks it starts) only
        if speculate:
            SPECULATIVE.set(True)
            tenant = identity.tenant
            pending.add_done_callback(
                lambda done: self._gate.speculation_over(tenant, not done.cancelled() and done.exception() is None)
            )
            return pending
        try:
            await asyncio.sleep(0)  # let the reservation send its Redis command before the router starts
        except BaseException:  # cancelled here: the reservation runs on, and is settled once it is known
            self._settle_once_admitted(pending)
            raise
        return pending

    def _settle_once_admitted(self, admission: asyncio.Future[Ticket]) -> None:
        """Settle the request's ticket now, or once a reservation still running has succeeded."""

        def settle(done: asyncio.Future[Ticket]) -> None:
            if not done.cancelled() and done.exception() is None:
                self._gate.settle_soon(done.result())

        if admission.done():
            settle(admission)
        else:
            admission.add_done_callback(settle)

    def _timeout(self, context: grpc.aio.ServicerContext, default_s: float, cap_s: float | None = None) -> float:
        """Seconds left for the router call: the caller's deadline or ``default_s``, capped at ``cap_s``
        (``max_deadline_s`` unless given)."""
        cap_s = self._settings.max_deadline_s if cap_s is None else cap_s
        remaining = context.time_remaining()
        if remaining is None:
            return min(default_s, cap_s)
        if remaining <= 0:
            raise DeadlineExceeded("the request's deadline passed before it could be forwarded; allow more time")
        return min(remaining, cap_s)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        key_id = str(structlog.contextvars.get_contextvars().get("key_id", ""))
        return outbound_metadata(self._settings.internal_token, **({md.KEY_ID: key_id} if key_id else {}))

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        with observe("Generate", self._settings) as observed:
            observed.prompt(request.prompt)
            request_id, identity = await self._admit(context, "Generate")
            timeout = self._timeout(context, self._settings.default_deadline_s)
            admission = await self._reservation(identity, request, stream_ttl_s=timeout)
            ticket: Ticket | None = None
            try:
                call = self._router.Generate(request, metadata=self._metadata(), timeout=timeout)
                _on_rpc_end(context, call, lambda: self._settle_once_admitted(admission))
                try:
                    sequence = 0
                    async with aclosing(coalesced(call, _merge, window=self._flush, urgent=_is_final)) as frames:
                        async for frame in frames:
                            if ticket is None:
                                ticket = await admission  # nothing reaches the caller before admission
                            final = frame.final if frame.HasField("final") else None
                            observed.frame(len(frame.token_ids), final, ticket)
                            frame.request_id = request_id
                            frame.sequence = sequence
                            sequence += 1
                            yield frame
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc, Upstream.ROUTER) from None
                finally:
                    call.cancel()
            finally:
                self._settle_once_admitted(admission)

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        with observe("Complete", self._settings) as observed:
            observed.prompt(request.prompt)
            request_id, identity = await self._admit(context, "Complete")
            timeout = self._timeout(context, self._settings.default_deadline_s)
            admission = await self._reservation(identity, request, stream_ttl_s=None)
            try:
                call = self._router.Complete(request, metadata=self._metadata(), timeout=timeout)
                try:
                    reply: pb.GenerateResponse = await call
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc, Upstream.ROUTER) from None
                finally:
                    call.cancel()
                ticket = await admission  # (already settled: the router waited for it before any work)
                observed.frame(len(reply.token_ids), reply.final if reply.HasField("final") else None, ticket)
            finally:
                self._settle_once_admitted(admission)
            reply.request_id = request_id
            return reply

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        with observe("ListModels", self._settings):
            await self._admit(context, "ListModels")
            call = self._router.ListModels(
                request, metadata=self._metadata(), timeout=self._timeout(context, self._settings.default_deadline_s)
            )
            try:
                reply: pb.ListModelsResponse = await call
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, Upstream.ROUTER) from None
            finally:
                call.cancel()
            return reply

    async def Chat(
        self, request_iterator: AsyncIterator[pb.ChatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ChatResponse]:
        """Bidirectional relay: one task pumps validated client frames up, one reads router frames.

        Both feed one queue so a validation error, a router error and a router frame reach the
        caller in the order they happened; leaving this generator for any reason cancels both.
        """
        with observe("Chat", self._settings) as observed:
            request_id, identity = await self._admit(context, "Chat", send_headers=True)
            policy = self._gate.policy(identity)
            timeout = self._timeout(context, self._settings.default_chat_deadline_s, self._settings.max_chat_deadline_s)
            # The session holds one stream slot; each turn takes one request and reserves its tokens.
            session = await self._gate.admit(identity, policy, (), 0, stream_ttl_s=timeout, count_request=False)
            turns: deque[Ticket] = deque()
            call = self._router.Chat(metadata=self._metadata(), timeout=timeout)

            def settle_all() -> None:
                for ticket in (*turns, session):
                    self._gate.settle_soon(ticket)

            _on_rpc_end(context, call, settle_all)
            events: asyncio.Queue[object] = asyncio.Queue(maxsize=64)

            async def pump() -> None:
                try:
                    async for frame in request_iterator:
                        validate_chat_request(frame, self._limits)
                        if frame.WhichOneof("action") == "turn":
                            turn = frame.turn
                            texts = [m.content for m in turn.messages]
                            turns.append(await self._gate.admit(identity, policy, texts, turn.sampling.max_tokens))
                            observed.prompt(*texts)
                            turn.routing.priority = min(turn.routing.priority, policy.priority)
                            observed.turn_started()
                        await call.write(frame)
                    await call.done_writing()
                except MeshError as exc:
                    await events.put(exc)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    pass  # the router call ended; read() reports how

            async def read() -> None:
                try:
                    async for frame in call:
                        await events.put(frame)
                    await events.put(_END)
                except grpc.aio.AioRpcError as exc:
                    await events.put(from_rpc_error(exc, Upstream.ROUTER))
                except MeshError as exc:  # the embedded router's own errors (services/gateway/local_router.py)
                    await events.put(exc)

            tasks = [asyncio.create_task(pump()), asyncio.create_task(read())]
            waiting = events._queue  # type: ignore[attr-defined]  # a peek; asyncio.Queue has no public one
            sequence = 0
            try:
                while (event := await events.get()) is not _END:
                    if isinstance(event, MeshError):
                        raise event
                    assert isinstance(event, pb.ChatResponse)
                    # Frames that came while the last one was written go out as one.
                    while waiting and isinstance(waiting[0], pb.ChatResponse) and _merge(event, waiting[0]):
                        events.get_nowait()
                    final = event.final if event.HasField("final") else None
                    observed.frame(len(event.token_ids), final, turns[0] if turns else None)
                    if final is not None and turns:
                        self._gate.settle_soon(turns.popleft())
                    event.request_id = request_id
                    event.sequence = sequence
                    sequence = 0 if final is not None else sequence + 1
                    yield event
            finally:
                call.cancel()
                for task in tasks:
                    task.cancel()
                settle_all()  # before the await below: a second cancellation there must not skip it
                await asyncio.gather(*tasks, return_exceptions=True)
