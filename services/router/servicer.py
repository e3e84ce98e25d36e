"""meshserve.v1.Inference as served by the router (to the gateway): protos in, Router calls, protos out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

import grpc
import structlog

from services.common import sampling_pb, tracing
from services.common.coalesce import FlushWindow, coalesced
from services.common.errors import InvalidArgument, MeshError, NotFound, ResourceExhausted
from services.common.metrics import REQUEST_DURATION, TOKENS
from services.common.pb.meshserve.v1 import inference_pb2, inference_pb2_grpc
from services.common.sampling import SamplingParams
from services.router import convert
from services.router.core import SERVICE, Chunk, Done, Router, Session, TurnRequest
from services.router.policy import TierName

log = structlog.get_logger(__name__)

# Tokenizing a long prompt takes milliseconds: do it off the event loop past this many characters.
_INLINE_TOKENIZE_CHARS = 4096
# Recently seen prompts (up to the inline size) keep their token ids: a repeated prompt (a cache hit,
# a client retrying) skips the tokenizer, whose call costs more than the rest of a cache hit.
_ENCODED_PROMPTS = 2048
# ...and at most this many token ids in all, kept as int32 (4 MiB): distinct 4 KiB prompts of one-char
# tokens would otherwise hold ~150 KiB each as tuples of ints (~300 MiB for the 2048 entries).
_ENCODED_TOKENS = 1 << 20


class _EncodeCache:
    """LRU of prompt text -> token ids, bounded by entries and by token ids held (each prompt is at most
    the inline size, so the texts hold at most ``size`` x 4 KiB characters)."""

    def __init__(self, size: int, max_tokens: int = _ENCODED_TOKENS) -> None:
        self._size = size
        self._max_tokens = max_tokens
        self._ids: OrderedDict[str, array[int]] = OrderedDict()
        self.tokens = 0
        """Token ids held now."""

    def get(self, text: str) -> list[int] | None:
        ids = self._ids.get(text)
        if ids is None:
            return None
        self._ids.move_to_end(text)
        return ids.tolist()

    def put(self, text: str, ids: list[int]) -> None:
        if len(ids) > self._max_tokens:
            return
        old = self._ids.pop(text, None)
        if old is not None:
            self.tokens -= len(old)
        self._ids[text] = array("i", ids)
        self.tokens += len(ids)
        while len(self._ids) > self._size or self.tokens > self._max_tokens:
            _, gone = self._ids.popitem(last=False)
            self.tokens -= len(gone)


class RouterServicer(inference_pb2_grpc.InferenceServicer):
    """The router's ``meshserve.v1.Inference`` service: tokenizes and validates, then runs the turn through
    :class:`Router`."""

    def __init__(
        self,
        router: Router,
        *,
        context_length: int,
        default_max_tokens: int,
        flush: FlushWindow | None = None,
        max_queued_chat_turns: int = 8,
    ) -> None:
        self._router = router
        self._flush = flush  # spaces a stream's frames while many streams are open (None: off)
        self._context_length = context_length
        self._default_max_tokens = default_max_tokens
        self._encoded = _EncodeCache(_ENCODED_PROMPTS)
        self._max_queued_turns = max_queued_chat_turns

    # -- helpers ---------------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model and model != self._router.model_id:
            raise NotFound(f"unknown model {model!r}; ListModels shows the served models ({self._router.model_id})")

    async def _encode(self, fn: Callable[[], list[int]], size: int) -> list[int]:
        with tracing.span("router.tokenize"):
            return fn() if size <= _INLINE_TOKENIZE_CHARS else await asyncio.to_thread(fn)

    async def _encode_prompt(self, prompt: str) -> list[int]:
        ids = self._encoded.get(prompt)
        if ids is not None:
            return ids
        ids = await self._encode(partial(self._router.tokenizer.encode, prompt), len(prompt))
        if len(prompt) <= _INLINE_TOKENIZE_CHARS:
            self._encoded.put(prompt, ids)
        return ids

    def _turn_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        routing_msg: inference_pb2.RoutingOptions,
        context: grpc.aio.ServicerContext,
    ) -> TurnRequest:
        hint, use_cache, shareable = convert.routing(routing_msg)
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty; send at least one character of text")
        spec = sampling.fit(len(prompt_ids), self._context_length, self._default_max_tokens)
        ctx = structlog.contextvars.get_contextvars()
        remaining = context.time_remaining()
        return TurnRequest(
            prompt_ids=prompt_ids,
            sampling=spec,
            hint=hint,
            use_cache=use_cache,
            shareable=shareable,
            tenant=str(ctx.get("tenant", "")),
            request_id=str(ctx.get("request_id", "")),
            timeout=remaining if remaining is not None and remaining < 1e9 else None,
            priority=routing_msg.priority,
        )

    async def _generate_events(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[Chunk | Done, None]:
        self._check_model(request.model)
        if not request.prompt:
            raise InvalidArgument("the prompt is empty; send at least one character of text")
        # Parameters are checked before tokenizing: bad ones are refused without the cost.
        sampling = sampling_pb.from_pb(request.sampling)
        ids = await self._encode_prompt(request.prompt)
        req = self._turn_request(ids, sampling, request.routing, context)
        session = Session()
        try:
            async with aclosing(self._router.run_turn(req, session)) as events:
                async for event in events:
                    yield event
        finally:
            await session.close()

    # -- RPCs ------------------------------------------------------------------------------------

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        async for frame in self.generate_frames(request, context):
            yield frame

    async def generate_frames(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext, *, coalesce: bool = True
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Generate's frames. ``coalesce=False``: for a caller in this process that merges frames itself
        (the gateway with the router embedded): a second coalescing reader per stream would be wasted."""
        request_id = str(structlog.contextvars.get_contextvars().get("request_id", ""))
        with _observe() as obs:
            seq = 0
            events = self._generate_events(request, context)
            if coalesce:
                events = coalesced(events, _merge, window=self._flush, urgent=_is_done)
            async with aclosing(events):
                async for event in events:
                    obs.record(event)
                    if isinstance(event, Chunk):
                        yield inference_pb2.GenerateResponse(
                            request_id=request_id, sequence=seq, token_ids=event.token_ids, text=event.text
                        )
                    else:
                        yield inference_pb2.GenerateResponse(request_id=request_id, sequence=seq, final=_final(event))
                    seq += 1

    async def Complete(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        request_id = str(structlog.contextvars.get_contextvars().get("request_id", ""))
        out = inference_pb2.GenerateResponse(request_id=request_id)
        texts: list[str] = []
        with _observe() as obs:
            async with aclosing(self._generate_events(request, context)) as events:
                async for event in events:
                    obs.record(event)
                    if isinstance(event, Chunk):
                        out.token_ids.extend(event.token_ids)
                        texts.append(event.text)
                    else:
                        out.final.CopyFrom(_final(event))
        out.text = "".join(texts)
        return out

    async def Chat(
        self, request_iterator: AsyncIterator[inference_pb2.ChatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.ChatResponse]:
        request_id = str(structlog.contextvars.get_contextvars().get("request_id", ""))
        inbox: asyncio.Queue[inference_pb2.ChatTurn | None] = asyncio.Queue()
        current_cancel: list[asyncio.Event] = []  # the cancel event of the turn in progress, if any
        overflow: list[ResourceExhausted] = []  # set when the client queued too many turns
        most = self._max_queued_turns

        async def read_client() -> None:
            try:
                async for msg in request_iterator:
                    if msg.HasField("cancel"):
                        if current_cancel:
                            current_cancel[0].set()
                    elif msg.HasField("turn"):
                        if inbox.qsize() >= most:
                            # Stop reading: the client's further frames wait in gRPC's flow control.
                            overflow.append(
                                ResourceExhausted(
                                    f"more than {most} chat turns were sent ahead of the turn in progress; "
                                    "send the next turn after the previous turn's final frame"
                                )
                            )
                            return
                        inbox.put_nowait(msg.turn)
            finally:
                inbox.put_nowait(None)

        reader = asyncio.create_task(read_client(), name="chat-client-reader")
        session = Session(chat=True)
        messages: list[dict[str, str]] = []
        hint: TierName | None = None
        turn_index = 0
        try:
            while (turn := await inbox.get()) is not None or overflow:
                if overflow:  # the queued turns are dropped with the stream
                    raise overflow[0]
                assert turn is not None
                with _observe() as obs:
                    if turn_index == 0:
                        self._check_model(turn.model)
                    if not turn.messages:
                        raise InvalidArgument("a chat turn needs at least one message")
                    new = [{"role": m.role, "content": m.content} for m in turn.messages]
                    sampling = sampling_pb.from_pb(turn.sampling)
                    conversation = messages + new
                    size = sum(len(m["content"]) for m in conversation)
                    ids = await self._encode(partial(self._router.tokenizer.apply_chat_template, conversation), size)
                    req = self._turn_request(ids, sampling, turn.routing, context)
                    if turn_index == 0:
                        hint = req.hint
                    req.hint = hint  # later turns stay where the first one went
                    cancel = asyncio.Event()
                    current_cancel[:] = [cancel]
                    seq = 0
                    reply: list[str] = []
                    async with aclosing(
                        coalesced(
                            self._router.run_turn(req, session, cancel), _merge, window=self._flush, urgent=_is_done
                        )
                    ) as events:
                        async for event in events:
                            obs.record(event)
                            if isinstance(event, Chunk):
                                reply.append(event.text)
                                frame = inference_pb2.ChatResponse(
                                    turn=turn_index,
                                    sequence=seq,
                                    token_ids=event.token_ids,
                                    text=event.text,
                                    request_id=request_id,
                                )
                            else:
                                frame = inference_pb2.ChatResponse(
                                    turn=turn_index, sequence=seq, final=_final(event), request_id=request_id
                                )
                            yield frame
                            seq += 1
                    current_cancel.clear()
                    # The conversation keeps what the client saw, also of a cancelled turn.
                    messages = [*conversation, {"role": "assistant", "content": "".join(reply)}]
                    turn_index += 1
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            await session.close()

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        tiers = sorted(self._router.registry.tiers(), key=lambda t: t.value, reverse=True)
        pb_tiers = [inference_pb2.TIER_EDGE if t is TierName.EDGE else inference_pb2.TIER_CLOUD for t in tiers]
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(id=self._router.model_id, tiers=pb_tiers, context_length=self._context_length)
            ]
        )


def _merge(first: Chunk | Done, then: Chunk | Done) -> Chunk | None:
    """Two chunks that waited for the writer as one (a Done stays a frame of its own)."""
    if isinstance(first, Chunk) and isinstance(then, Chunk):
        return Chunk([*first.token_ids, *then.token_ids], first.text + then.text)
    return None


def _is_done(event: Chunk | Done) -> bool:
    return isinstance(event, Done)


def _final(done: Done) -> inference_pb2.Final:
    return convert.final_pb(done.finish_reason, done.prompt_tokens, done.completion_tokens, done.route)


class _Observation:
    """Duration by status, token counters, for one request or chat turn."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.tier = "none"

    def record(self, event: Any) -> None:
        if isinstance(event, Done):
            self.tier = "cache" if event.route.cache_hit or not event.route.tier else event.route.tier.value
            TOKENS.labels(SERVICE, self.tier, "input").inc(event.prompt_tokens)
            TOKENS.labels(SERVICE, self.tier, "output").inc(event.completion_tokens)


@contextlib.contextmanager
def _observe() -> Any:
    obs = _Observation()
    status = "OK"
    try:
        yield obs
    except MeshError as exc:
        status = exc.code
        raise
    except (asyncio.CancelledError, GeneratorExit):
        status = "CANCELLED"
        raise
    except BaseException:
        status = "INTERNAL"
        raise
    finally:
        REQUEST_DURATION.labels(SERVICE, obs.tier, status).observe(time.perf_counter() - obs.started)
