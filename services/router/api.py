"""The router's transport-free API: a request and its admission in, a stream of events out.

:class:`RouterAPI` is what a caller of the router calls: the gateway in its own process (the
embedded layout, ``meshserve up``), and the router's gRPC servicer (services/router/servicer.py),
which only translates protos, for a gateway in another process. It checks the model id, tokenizes
(a text with the tokenizer, a conversation through the chat template), fits ``max_tokens`` to the
context (:meth:`SamplingParams.fit`), and runs the turn through :class:`~services.router.core.Router`.
It records the router's request metrics (duration by status, tokens by tier) for every caller.

* :meth:`RouterAPI.generate`: one prompt -> :class:`Chunk` events and one :class:`Done`.
* :meth:`RouterAPI.chat`: a :class:`ChatSession`; turns in, :class:`TurnEvent`\\ s out; the
  conversation and the worker stream outlive each turn.
* :meth:`RouterAPI.list_models`.

Deadlines are absolute ``time.monotonic()`` instants (None: none); the time left when a turn starts
bounds its worker call. Errors are domain errors (:class:`~services.common.errors.MeshError`) whose
messages are written for callers. Closing an event stream (the caller went away) stops the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing
from functools import partial

from services.common import tracing
from services.common.errors import InvalidArgument, MeshError, NotFound, ResourceExhausted
from services.common.logprobs import TokenLogprob
from services.common.metrics import REQUEST_DURATION, TOKENS
from services.common.sampling import SamplingParams
from services.router.core import SERVICE, Router, Session
from services.router.policy import TierName
from services.router.types import (
    ChatTurn,
    Chunk,
    Done,
    Event,
    Generation,
    ModelInfo,
    PendingAdmission,
    Routing,
    TurnEvent,
    TurnRequest,
)

# Tokenizing a long prompt takes milliseconds: do it off the event loop past this many characters.
INLINE_TOKENIZE_CHARS = 4096
# Recently seen prompts (up to the inline size) keep their token ids: a repeated prompt (a cache hit,
# a client retrying) skips the tokenizer, whose call costs more than the rest of a cache hit.
ENCODED_PROMPTS = 2048
# ...and at most this many token ids in all, kept as int32 (4 MiB): distinct 4 KiB prompts of one-char
# tokens would otherwise hold ~150 KiB each as tuples of ints (~300 MiB for the 2048 entries).
_ENCODED_TOKENS = 1 << 20


class EncodeCache:
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


def _time_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class RouterAPI:
    """The router as its callers see it (see the module docstring); an ``InferenceRouter``."""

    overlaps_admission = True

    def __init__(
        self, router: Router, *, context_length: int, default_max_tokens: int, max_queued_chat_turns: int = 8
    ) -> None:
        self.router = router
        self.context_length = context_length
        self._default_max_tokens = default_max_tokens
        self._encoded = EncodeCache(ENCODED_PROMPTS)
        self.max_queued_chat_turns = max_queued_chat_turns

    @property
    def model_id(self) -> str:
        return self.router.model_id

    def check_model(self, model: str) -> None:
        if model and model != self.router.model_id:
            raise NotFound(f"unknown model {model!r}; ListModels shows the served models ({self.router.model_id})")

    async def list_models(self, *, deadline: float | None = None) -> list[ModelInfo]:
        """The served model, with the tiers that have replicas now (cloud first)."""
        tiers = sorted(self.router.registry.tiers(), key=lambda t: t.value, reverse=True)
        return [ModelInfo(self.router.model_id, tuple(tiers), self.context_length)]

    async def generate(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> AsyncGenerator[Event, None]:
        """Serve one prompt: :class:`Chunk` events, then one :class:`Done`.

        ``admission``: the caller's rate-limit reservation if it is still pending (None: admitted,
        or no limits): see :class:`PendingAdmission`. ``deadline``: see the module docstring.
        """
        with observe() as obs:
            self.check_model(request.model)
            if not request.prompt:
                raise InvalidArgument("the prompt is empty; send at least one character of text")
            ids = await self._encode_prompt(request.prompt)
            req = self.turn_request(ids, request.sampling, request.routing, request.tenant, request.request_id)
            req.timeout = _time_left(deadline)
            session = Session()
            try:
                async with aclosing(self.router.run_turn(req, session, None, admission)) as events:
                    async for event in events:
                        obs.record(event)
                        yield event
            finally:
                await session.close()

    async def complete(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> tuple[Chunk, Done]:
        """:meth:`generate`'s events as one: all the output in one chunk, and the Done."""
        token_ids: list[int] = []
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        done: Done | None = None
        async with aclosing(self.generate(request, admission, deadline=deadline)) as events:
            async for event in events:
                if isinstance(event, Chunk):
                    token_ids.extend(event.token_ids)
                    texts.append(event.text)
                    logprobs.extend(event.logprobs)
                else:
                    done = event
        assert done is not None  # a turn always ends with its Done
        return Chunk(token_ids, "".join(texts), tuple(logprobs)), done

    def chat(self, *, tenant: str = "", request_id: str = "", deadline: float | None = None) -> ChatSession:
        """A chat session: send it turns, read its events (see :class:`ChatSession`)."""
        return ChatSession(self, tenant, request_id, deadline)

    # -- the parts of a request ------------------------------------------------------------------

    def turn_request(
        self, prompt_ids: list[int], sampling: SamplingParams, routing: Routing, tenant: str, request_id: str
    ) -> TurnRequest:
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty; send at least one character of text")
        sampling = sampling.fit(
            len(prompt_ids), self.context_length, self._default_max_tokens, vocab_size=self.router.tokenizer.vocab_size
        )
        return TurnRequest(
            prompt_ids=prompt_ids,
            sampling=sampling,
            hint=routing.hint,
            use_cache=routing.use_cache,
            shareable=routing.shareable,
            tenant=tenant,
            request_id=request_id,
            priority=routing.priority,
        )

    async def _encode(self, fn: Callable[[], list[int]], size: int) -> list[int]:
        with tracing.span("router.tokenize"):
            return fn() if size <= INLINE_TOKENIZE_CHARS else await asyncio.to_thread(fn)

    async def _encode_prompt(self, prompt: str) -> list[int]:
        ids = self._encoded.get(prompt)
        if ids is not None:
            return ids
        ids = await self._encode(partial(self.router.tokenizer.encode, prompt), len(prompt))
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            self._encoded.put(prompt, ids)
        return ids

    async def encode_chat(self, conversation: list[dict[str, str]]) -> list[int]:
        size = sum(len(m["content"]) for m in conversation)
        return await self._encode(partial(self.router.tokenizer.apply_chat_template, conversation), size)


class ChatSession:
    """One chat (a ``ChatChannel``): :meth:`send` turns (and :meth:`cancel_turn`, :meth:`end`), read
    :meth:`events`.

    Turns are served one after the other on one worker stream, each over the whole conversation so
    far (the replies as the caller saw them, also of a cancelled turn); later turns keep the first
    turn's tier hint. More than ``max_queued_chat_turns`` turns sent ahead of the turn in progress
    end the session with RESOURCE_EXHAUSTED once that turn is done. Turns are admitted by the caller
    before they are sent. Closing :meth:`events` closes the worker stream.
    """

    def __init__(self, api: RouterAPI, tenant: str, request_id: str, deadline: float | None) -> None:
        self._api = api
        self._tenant = tenant
        self._request_id = request_id
        self._deadline = deadline
        self._inbox: asyncio.Queue[ChatTurn | MeshError | None] = asyncio.Queue()
        self._ended = False
        self._overflow: ResourceExhausted | None = None
        self._cancel: asyncio.Event | None = None  # the turn in progress's, if any

    async def send(self, turn: ChatTurn) -> bool:
        """Queue a turn (served after those sent before it); False once the session takes no more turns."""
        if self._ended:
            return False
        most = self._api.max_queued_chat_turns
        if self._inbox.qsize() >= most:  # the queued turns are dropped with the session
            self._overflow = ResourceExhausted(
                f"more than {most} chat turns were sent ahead of the turn in progress; "
                "send the next turn after the previous turn's final frame"
            )
            self._close_inbox()
            return False
        self._inbox.put_nowait(turn)
        return True

    async def cancel_turn(self) -> None:
        """End the turn in progress early (it still ends with a Done, CANCELLED); none: nothing."""
        if self._cancel is not None:
            self._cancel.set()

    def fail(self, error: MeshError) -> None:
        """End the session with ``error`` after the turns sent before it (a turn the caller could not
        make sense of: the error comes where the turn would have)."""
        if not self._ended:
            self._ended = True
            self._inbox.put_nowait(error)

    async def end(self) -> None:
        """No more turns: :meth:`events` ends after the turns already sent."""
        self._close_inbox()

    def _close_inbox(self) -> None:
        if not self._ended:
            self._ended = True
            self._inbox.put_nowait(None)

    async def events(self) -> AsyncGenerator[TurnEvent, None]:
        """The events of every turn, in order, until :meth:`end` (or an error)."""
        api = self._api
        session = Session(chat=True)
        messages: list[dict[str, str]] = []
        hint: TierName | None = None
        index = 0
        try:
            while (turn := await self._next()) is not None:
                with observe() as obs:
                    if index == 0:
                        api.check_model(turn.model)
                    if not turn.messages:
                        raise InvalidArgument("a chat turn needs at least one message")
                    conversation = messages + [{"role": m.role, "content": m.content} for m in turn.messages]
                    ids = await api.encode_chat(conversation)
                    req = api.turn_request(ids, turn.sampling, turn.routing, self._tenant, self._request_id)
                    req.timeout = _time_left(self._deadline)
                    if index == 0:
                        hint = req.hint
                    req.hint = hint  # later turns stay where the first one went
                    self._cancel = cancel = asyncio.Event()
                    reply: list[str] = []
                    async with aclosing(api.router.run_turn(req, session, cancel)) as events:
                        async for event in events:
                            obs.record(event)
                            if isinstance(event, Chunk):
                                reply.append(event.text)
                            yield TurnEvent(index, event)
                    self._cancel = None
                    # The conversation keeps what the caller saw, also of a cancelled turn.
                    messages = [*conversation, {"role": "assistant", "content": "".join(reply)}]
                    index += 1
        finally:
            self._ended = True
            await session.close()

    async def _next(self) -> ChatTurn | None:
        item = await self._inbox.get()
        if self._overflow is not None:
            raise self._overflow
        if isinstance(item, MeshError):
            with observe():  # a turn refused at the edge is a turn that failed
                raise item
        return item


class _Observation:
    """Duration by status, token counters, for one request or chat turn."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.tier = "none"

    def record(self, event: Event) -> None:
        if isinstance(event, Done):
            self.tier = "cache" if event.route.cache_hit or not event.route.tier else event.route.tier.value
            TOKENS.labels(SERVICE, self.tier, "input").inc(event.prompt_tokens)
            TOKENS.labels(SERVICE, self.tier, "output").inc(event.completion_tokens)


@contextlib.contextmanager
def observe() -> Iterator[_Observation]:
    """The router's request metrics for the block: duration by status and tier, tokens."""
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


@contextlib.contextmanager
def observe_refusal() -> Iterator[None]:
    """For an edge's work before it calls the API (converting its request): a refusal there is recorded
    as the router's metrics record a failed request; success records nothing (the API does)."""
    started = time.perf_counter()
    try:
        yield
    except MeshError as exc:
        REQUEST_DURATION.labels(SERVICE, "none", exc.code).observe(time.perf_counter() - started)
        raise
