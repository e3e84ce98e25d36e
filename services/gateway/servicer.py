"""The public `meshserve.v1.Inference` service: authenticate, validate, then call the router.

The router is an :class:`~services.router.types.InferenceRouter`: the router's own API in this process
(the embedded layout, :class:`~services.router.frontend.api.RouterAPI`) or a client of one in another
(:class:`~services.gateway.remote_router.RemoteRouter`); this servicer has one path for both. It turns
the public protos into the router's domain requests, and the router's events into frames, which it
numbers and stamps with its request id (nothing else does). Deadlines: the caller's (capped at
``max_deadline_s``; a Chat session at ``max_chat_deadline_s``) or a default is passed to the router.
Cancellation: leaving a handler closes the router's event stream, which stops the worker. Errors are
the router's domain errors, written for callers.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
import structlog

from services.common import logprobs_pb, tracing
from services.common import metadata as md
from services.common.coalesce import coalesced
from services.common.errors import DeadlineExceeded, InvalidArgument, MeshError, Unavailable
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.gateway import scopes
from services.gateway.admission import Gate, Ticket
from services.gateway.config import GatewaySettings
from services.gateway.identity import Identity
from services.gateway.observe import observe
from services.gateway.policy import check_embed_inputs
from services.gateway.validation import GrammarChecks, Limits, validate_chat_request, validate_embed, validate_generate
from services.router.frontend import convert
from services.router.types import (
    Chunk,
    Done,
    Generation,
    InferenceRouter,
    PendingAdmission,
    TurnEvent,
    is_done,
    merge,
    merge_turn,
)
from services.store.keys import scope_tag

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_END = object()
_closing: set[asyncio.Task[None]] = set()


async def _after_the_worker_start(admit: Awaitable[Ticket]) -> Ticket:
    """A speculative start's reservation, begun one event-loop turn late: the router, which runs on
    without a pause, has queued the worker's start by then, so the start is written first and the
    Redis command right after it (docs/gateway.md, *Numbers*: ~0.1 ms less to the first token)."""
    await asyncio.sleep(0)
    return await admit


def _close_soon(stream: AsyncGenerator[Any, None]) -> None:
    """Close ``stream`` unless it is running (then whoever runs it is being cancelled and closes it)
    or has ended."""
    if getattr(stream, "ag_running", False) or getattr(stream, "ag_frame", None) is None:
        return
    task = asyncio.get_running_loop().create_task(stream.aclose())
    _closing.add(task)  # a task nobody references may be collected before it has run
    task.add_done_callback(_closing.discard)


def _on_rpc_end(context: grpc.aio.ServicerContext, stop: Callable[[], None], settle: Callable[[], None]) -> None:
    """However the RPC ends, stop the router's work and settle the request's tickets (both idempotent).

    The handler's own ``finally`` does both, but a handler (an async generator) that its RPC's
    cancellation leaves suspended at a ``yield`` runs its ``finally`` only once it is garbage
    collected, which can be much later: its stream slot would stay leased and the worker busy.
    """

    def ended(_context: object) -> None:
        stop()
        settle()

    context.add_done_callback(ended)


class GatewayServicer(inference_pb2_grpc.InferenceServicer):
    """The public API over the router, after authentication and validation.

    ``router`` may be set after construction (with the router embedded, the gateway's server starts
    first, so the process's tracing and its announced port are the gateway's); until then calls
    fail with UNAVAILABLE.
    """

    def __init__(self, settings: GatewaySettings, gate: Gate, router: InferenceRouter | None) -> None:
        self._settings = settings
        self._gate = gate
        self.router = router
        self._flush = settings.flush_window()  # spaces a stream's frames while many are open
        self._limits = Limits(
            max_prompt_chars=settings.max_prompt_chars,
            max_tokens=settings.max_tokens_limit,
            max_stop_strings=settings.max_stop_strings,
            max_stop_chars=settings.max_stop_chars,
            max_chat_messages=settings.max_chat_messages,
            max_model_chars=settings.max_model_chars,
            max_embed_inputs=settings.max_embed_inputs,
            max_embed_chars=settings.max_embed_chars,
        )
        self._grammars = GrammarChecks()  # structured-output constraints, checked before they are forwarded

    def _router(self) -> InferenceRouter:
        if self.router is None:
            raise Unavailable("the gateway's router is still starting; retry in a moment")
        return self.router

    async def _admit(
        self, context: grpc.aio.ServicerContext, method: str, *, send_headers: bool = False
    ) -> tuple[str, Identity]:
        """Assign the request id, authenticate, check the method's scope, bind id + tenant + key id
        for logs and metadata.

        ``x-request-id`` (and ``x-meshserve-tenant-scope`` for a credential with the inference scope) goes
        back in the trailing metadata (with the status, on success and on
        every error after this point) and in every response message. Response headers carrying it
        are sent only with ``send_headers`` (Chat, whose clients wait for them before writing):
        a separate headers operation costs a unary call or a stream a sizeable share of the
        gateway's CPU (docs/benchmarks/hops.md), while the first message carries empty headers free.
        """
        request_id = uuid.uuid4().hex
        # Overwrite whatever the caller put in x-request-id / x-meshserve-tenant: nothing from a
        # public caller is trusted until its credential has resolved the tenant.
        structlog.contextvars.bind_contextvars(request_id=request_id, tenant="", key_id="")
        metadata = context.invocation_metadata() or ()
        unreadable = md.unreadable_key(metadata)
        if unreadable is not None:
            raise InvalidArgument(
                f"the {unreadable!r} metadata is not printable ASCII (invalid UTF-8 or other bytes);"
                " send text metadata as ASCII, or binary data under a key ending in -bin"
            )
        identity = await self._gate.identify(metadata)
        structlog.contextvars.bind_contextvars(tenant=identity.tenant, key_id=identity.key_id)
        tracing.annotate({"meshserve.request_id": request_id, "meshserve.tenant": identity.tenant})
        scopes.require(method, identity.scopes, identity.key_id)
        # The tenant's digest goes back to a credential that may run inference: the HTTP adapter keeps
        # its stored /v1/responses under it (docs/gateway.md, "Responses").
        tenant = (
            ((md.TENANT_SCOPE, scope_tag(identity.tenant, False)),) if scopes.grants("Chat", identity.scopes) else ()
        )
        context.set_trailing_metadata(((md.REQUEST_ID, request_id), *tenant))
        if send_headers:
            await context.send_initial_metadata(((md.REQUEST_ID, request_id), *tenant))
        return request_id, identity

    async def _reservation(
        self, identity: Identity, request: pb.GenerateRequest, request_id: str, stream_ttl_s: float | None
    ) -> tuple[Generation, PendingAdmission]:
        """Validation, policy checks and the rate-limit reservation of a Generate/Complete request.

        Validation errors raise here. The reservation is awaited here too, unless the router runs in
        this process (and the tenant was not refused lately): then it runs on while the router
        prepares the request (:class:`~services.router.types.PendingAdmission`: the caller gets
        nothing until it succeeds, and a worker gets work only then, except for the few requests per
        tenant :meth:`Gate.speculate` lets start at once). Either way the admission's decision holds
        the ticket, and :meth:`_settle_once_admitted` must be called with it when the request ends.
        """
        sampling = validate_generate(request, self._limits)
        scopes.require_model(request.model, identity.models, identity.key_id)
        await self._grammars.check(sampling)
        policy = self._gate.policy(identity)
        request.routing.priority = min(request.routing.priority, policy.priority)
        generation = convert.generation(request, tenant=identity.tenant, request_id=request_id, sampling=sampling)
        prompts, max_tokens = [request.prompt], request.sampling.max_tokens * sampling.n  # n choices: n answers
        admit = self._gate.admit(identity, policy, prompts, max_tokens, stream_ttl_s=stream_ttl_s)
        router = self.router
        overlap = router is not None and router.overlaps_admission and self._settings.overlap_admission
        if not overlap or self._gate.recently_refused(identity.tenant):
            done: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
            done.set_result(await admit)
            return generation, PendingAdmission(done)
        speculate = self._gate.speculate(identity.tenant)
        pending = asyncio.ensure_future(_after_the_worker_start(admit) if speculate else admit)
        if speculate:
            tenant = identity.tenant
            pending.add_done_callback(
                lambda done: self._gate.speculation_over(tenant, not done.cancelled() and done.exception() is None)
            )
            return generation, PendingAdmission(pending, speculative=True)
        try:
            await asyncio.sleep(0)  # let the reservation send its Redis command before the router starts
        except BaseException:  # cancelled here: the reservation runs on, and is settled once it is known
            self._settle_once_admitted(pending)
            raise
        return generation, PendingAdmission(pending)

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
        """Seconds left for the router: the caller's deadline or ``default_s``, capped at ``cap_s``
        (``max_deadline_s`` unless given)."""
        cap_s = self._settings.max_deadline_s if cap_s is None else cap_s
        remaining = context.time_remaining()
        if remaining is None:
            return min(default_s, cap_s)
        if remaining <= 0:
            raise DeadlineExceeded("the request's deadline passed before it could be forwarded; allow more time")
        return min(remaining, cap_s)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        with observe("Generate", self._settings) as observed:
            observed.prompt(request.prompt)
            request_id, identity = await self._admit(context, "Generate")
            timeout = self._timeout(context, self._settings.default_deadline_s)
            deadline = time.monotonic() + timeout
            generation, admission = await self._reservation(identity, request, request_id, stream_ttl_s=timeout)
            ticket: Ticket | None = None
            try:
                events = self._router().generate(generation, admission, deadline=deadline)
                frames = coalesced(events, merge, window=self._flush, urgent=is_done)
                _on_rpc_end(
                    context, lambda: _close_soon(frames), lambda: self._settle_once_admitted(admission.decision)
                )
                sequence = 0
                async with aclosing(frames):
                    async for event in frames:
                        if ticket is None:
                            ticket = await admission.decision  # nothing reaches the caller before admission
                        if isinstance(event, Chunk):
                            observed.frame(len(event.token_ids), None, ticket)
                            frame = pb.GenerateResponse(
                                request_id=request_id,
                                sequence=sequence,
                                token_ids=event.token_ids,
                                text=event.text,
                                index=event.index,
                            )
                            if event.logprobs:
                                frame.logprobs.extend(logprobs_pb.to_pb(event.logprobs))
                        else:
                            final = convert.done_pb(event)
                            observed.frame(0, final, ticket)
                            frame = pb.GenerateResponse(
                                request_id=request_id, sequence=sequence, final=final, index=event.index
                            )
                        sequence += 1
                        yield frame
            finally:
                self._settle_once_admitted(admission.decision)

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        with observe("Complete", self._settings) as observed:
            observed.prompt(request.prompt)
            request_id, identity = await self._admit(context, "Complete")
            deadline = time.monotonic() + self._timeout(context, self._settings.default_deadline_s)
            generation, admission = await self._reservation(identity, request, request_id, stream_ttl_s=None)
            try:
                chunk, done = await self._router().complete(generation, admission, deadline=deadline)
                ticket = await admission.decision  # (already settled: the router waited for it before any work)
                final = convert.done_pb(done)
                observed.frame(len(chunk.token_ids), final, ticket)
            finally:
                self._settle_once_admitted(admission.decision)
            return pb.GenerateResponse(
                request_id=request_id,
                token_ids=chunk.token_ids,
                text=chunk.text,
                final=final,
                logprobs=logprobs_pb.to_pb(chunk.logprobs),
            )

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        with observe("ListModels", self._settings):
            _, identity = await self._admit(context, "ListModels")
            deadline = time.monotonic() + self._timeout(context, self._settings.default_deadline_s)
            served = await self._router().list_models(deadline=deadline)
            allowed = [m for m in served if not identity.models or m.id in identity.models]
            return convert.models_pb(allowed)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """Embeddings of the request's inputs: validated, admitted (the rate limit counts the inputs'
        tokens: estimated from the texts, one per token id; settled with the real count), then one
        call of the router."""
        with observe("Embed", self._settings) as observed:
            request_id, identity = await self._admit(context, "Embed")
            validate_embed(request, self._limits)
            scopes.require_model(request.model, identity.models, identity.key_id)
            deadline = time.monotonic() + self._timeout(context, self._settings.default_deadline_s)
            policy = self._gate.policy(identity)
            check_embed_inputs(policy, [item.text or len(item.token_ids) for item in request.inputs])
            texts = [item.text for item in request.inputs if item.text]
            ids = sum(len(item.token_ids) for item in request.inputs)
            ticket = await self._gate.admit(identity, policy, texts, 0, embed_tokens=ids)
            try:
                query = convert.embed_query(request, tenant=identity.tenant, request_id=request_id)
                result = await self._router().embed(query, deadline=deadline)
                ticket.used = result.prompt_tokens
                observed.embedded(result.prompt_tokens, result.route.worker_id)
            finally:
                self._gate.settle_soon(ticket)
            return convert.embeddings_pb(result, request_id)

    async def Chat(
        self, request_iterator: AsyncIterator[pb.ChatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ChatResponse]:
        """Bidirectional relay: one task pumps validated client frames to the router, one reads its events.

        Both feed one queue so a validation error, a router error and a router event reach the
        caller in the order they happened; leaving this generator for any reason cancels both.
        """
        with observe("Chat", self._settings) as observed:
            request_id, identity = await self._admit(context, "Chat", send_headers=True)
            policy = self._gate.policy(identity)
            timeout = self._timeout(context, self._settings.default_chat_deadline_s, self._settings.max_chat_deadline_s)
            deadline = time.monotonic() + timeout
            # The session holds one stream slot; each turn takes one request and reserves its tokens.
            session = await self._gate.admit(identity, policy, (), 0, stream_ttl_s=timeout, count_request=False)
            turns: deque[Ticket] = deque()

            def settle_all() -> None:
                for ticket in (*turns, session):
                    self._gate.settle_soon(ticket)

            try:
                chat = self._router().chat(tenant=identity.tenant, request_id=request_id, deadline=deadline)
            except BaseException:
                settle_all()
                raise
            events: asyncio.Queue[object] = asyncio.Queue(maxsize=64)

            async def pump() -> None:
                try:
                    async for frame in request_iterator:
                        turn_sampling = validate_chat_request(frame, self._limits)
                        await self._grammars.check(turn_sampling)
                        if frame.WhichOneof("action") == "turn":
                            turn = frame.turn
                            scopes.require_model(turn.model, identity.models, identity.key_id)
                            turn.routing.priority = min(turn.routing.priority, policy.priority)
                            domain_turn = convert.chat_turn(turn, turn_sampling)
                            texts = [m.content for m in turn.messages]
                            # Tools are prompt text too (rendered by the router): counted in the estimate.
                            texts += [t.description + t.parameters_json for t in turn.tools]
                            texts += [c.arguments for m in turn.messages for c in m.tool_calls]
                            budget = turn.sampling.max_tokens * domain_turn.sampling.n  # n choices: n answers
                            turns.append(await self._gate.admit(identity, policy, texts, budget))
                            observed.prompt(*texts)
                            observed.turn_started()
                            await chat.send(domain_turn)
                        else:
                            await chat.cancel_turn()
                    await chat.end()
                except MeshError as exc:
                    await events.put(exc)

            async def read() -> None:
                try:
                    async with aclosing(chat.events()) as stream:
                        async for event in stream:
                            await events.put(event)
                    await events.put(_END)
                except MeshError as exc:
                    await events.put(exc)

            tasks = [asyncio.create_task(pump()), asyncio.create_task(read())]

            def stop() -> None:
                for task in tasks:
                    task.cancel()

            _on_rpc_end(context, stop, settle_all)
            waiting = events._queue  # type: ignore[attr-defined]  # a peek; asyncio.Queue has no public one
            sequence = 0
            try:
                while (event := await events.get()) is not _END:
                    if isinstance(event, MeshError):
                        raise event
                    assert isinstance(event, TurnEvent)
                    # Events that came while the last one was written go out as one frame.
                    while waiting and isinstance(waiting[0], TurnEvent) and (merged := merge_turn(event, waiting[0])):
                        event = merged
                        events.get_nowait()
                    if isinstance(event.event, Chunk):
                        observed.frame(len(event.event.token_ids), None, turns[0] if turns else None)
                        chunk = event.event
                        frame = pb.ChatResponse(
                            turn=event.turn,
                            token_ids=chunk.token_ids,
                            text=chunk.text,
                            tool_calls=convert.tool_calls_pb(chunk.tool_calls),
                            index=chunk.index,
                        )
                        if chunk.logprobs:
                            frame.logprobs.extend(logprobs_pb.to_pb(chunk.logprobs))
                    else:
                        final = convert.done_pb(event.event)
                        observed.frame(0, final, turns[0] if turns else None)
                        if turns and event.event.last:
                            self._gate.settle_soon(turns.popleft())
                        frame = pb.ChatResponse(turn=event.turn, final=final, index=event.event.index)
                    frame.request_id = request_id
                    frame.sequence = sequence
                    ended = isinstance(event.event, Done) and event.event.last
                    sequence = 0 if ended else sequence + 1  # numbered per turn
                    yield frame
            finally:
                stop()
                settle_all()  # before the await below: a second cancellation there must not skip it
                await asyncio.gather(*tasks, return_exceptions=True)
