"""The router's transport-free API: a request and its admission in, a stream of events out.

:class:`RouterAPI` is what a caller of the router calls: the gateway in its own process (the
embedded layout, ``meshserve up``), and the router's gRPC servicer (services/router/frontend/servicer.py),
which only translates protos, for a gateway in another process. It checks the model id, tokenizes
(a text with the tokenizer, a conversation through the chat template), fits ``max_tokens`` to the
context (:meth:`SamplingParams.fit`), and runs the turn through :class:`~services.router.balancer.core.Router`.
It records the router's request metrics (duration by status, tokens by tier: services/router/frontend/observe.py)
for every caller; long prompts are tokenized off the event loop (services/router/frontend/encoding.py).

Several models: the request's ``model`` (empty: the default one) names a served model
(services/router/frontend/models.py); its rollout picks the version (services/router/frontend/rollout.py) once per
Generate or once per chat (a chat never changes version), and the turn runs on that version's Router
only (its replicas, caches and tokenizer). Each version's outcome and TTFT feed its rollout's automatic
rollback (services/router/frontend/versions.py, as the shadow copies). With a shadow version set, a copy of each
Generate and each chat turn that succeeded runs there in the background (at most
``shadow_max_in_flight`` at once; more are shed), with no cache and no rate-limit charge; its output is
discarded, its TTFT and agreement with the primary are counted. A chat turn's copy is one stand-alone
generation over the whole conversation so far (a fresh worker stream each turn): the primary's chat
stream, and the KV its worker keeps between turns, are never touched by it.

* :meth:`RouterAPI.generate`: one prompt -> :class:`Chunk` events and one :class:`Done`.
* :meth:`RouterAPI.chat`: a :class:`ChatSession`; turns in, :class:`TurnEvent`\\ s out; the
  conversation and the worker stream outlive each turn. A turn with tools has them rendered by the
  chat template and its output parsed into tool-call deltas (services/router/tools.py,
  tool_parser.py; docs/gateway.md, *Tools*).
* :meth:`RouterAPI.list_models`.
* :meth:`RouterAPI.embed`: inputs -> :class:`Embeddings` (one call to a cloud replica).

Deadlines are absolute ``time.monotonic()`` instants (None: none); the time left when a turn starts
bounds its worker call. Errors are domain errors (:class:`~services.common.errors.MeshError`) whose
messages are written for callers. Closing an event stream (the caller went away) stops the worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import Any

from services.common import tracing
from services.common.errors import InvalidArgument, MeshError, ResourceExhausted
from services.common.generation import FinishReason
from services.common.logprobs import TokenLogprob
from services.common.metrics import REQUEST_DURATION, TOKENS
from services.common.sampling import SamplingParams
from services.router.balancer.core import SERVICE, Router, Session
from services.router.balancer.tiers import TierName
from services.router.frontend.embeddings import MAX_EMBED_TOKENS, EmbedRoute, check_tokens
from services.router.frontend.encoding import ENCODED_PROMPTS, INLINE_TOKENIZE_CHARS, EncodeCache, tokenize
from services.router.frontend.models import ModelTable, ServedModel, ServedVersion
from services.router.frontend.observe import observe
from services.router.frontend.tool_parser import ToolCallParser
from services.router.frontend.versions import Shadows, VersionRun, shadow_copy, shadow_of
from services.router.tools import (
    ToolCallDelta,
    ToolChoiceMode,
    calls_possible,
    constrained,
    effective_choice,
    prompt_tools,
    tools_key,
)
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
    Routing,
    TurnEvent,
    TurnRequest,
)


def _time_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class RouterAPI:
    """The router as its callers see it (see the module docstring); an ``InferenceRouter``."""

    overlaps_admission = True

    def __init__(
        self,
        router: Router,
        *,
        context_length: int,
        default_max_tokens: int,
        max_queued_chat_turns: int = 8,
        models: ModelTable | None = None,
        shadow_max_in_flight: int = 8,
        max_embed_tokens: int = MAX_EMBED_TOKENS,
    ) -> None:
        self.router = router
        """The default model's first version (the only one without a models file)."""
        self._embed_route = EmbedRoute(router.registry, router.internal_token)
        self._max_embed_tokens = max_embed_tokens
        self.context_length = context_length
        self._default_max_tokens = default_max_tokens
        self.models = models or ModelTable.single(router, context_length)
        self._encoded = {m: EncodeCache(ENCODED_PROMPTS) for m in self.models.models}
        self.max_queued_chat_turns = max_queued_chat_turns
        self._shadows = Shadows(shadow_max_in_flight)
        self.shadows = self._shadows.running
        """Shadow copies running now (tests wait on them)."""

    @property
    def model_id(self) -> str:
        return self.models.default

    def check_model(self, model: str) -> ServedModel:
        """The served model ``model`` names (empty: the default); NotFound names the served ones."""
        return self.models.get(model)

    async def list_models(self, *, deadline: float | None = None) -> list[ModelInfo]:
        """The served models, the default one first (the HTTP adapter names it in answers to requests that
        name none), each with the tiers that have replicas now (cloud first), its primary version's
        generation defaults and model state (a sleeping or stopped model is listed too)."""
        models = sorted(self.models.models.values(), key=lambda m: m.id != self.models.default)
        return [
            ModelInfo(
                m.id,
                tuple(sorted(m.tiers(), key=lambda t: t.value, reverse=True)),
                m.context_length,
                m.defaults,
                m.state(),
            )
            for m in models
        ]

    async def generate(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> AsyncGenerator[Event, None]:
        """Serve one prompt: :class:`Chunk` events, then one :class:`Done`.

        ``admission``: the caller's rate-limit reservation if it is still pending (None: admitted,
        or no limits): see :class:`PendingAdmission`. ``deadline``: see the module docstring.
        """
        with observe() as obs:
            model = self.check_model(request.model)
            if not request.prompt:
                raise InvalidArgument("the prompt is empty; send at least one character of text")
            version = model.choose(request.tenant)
            ids = await self._encode_prompt(request.prompt, model)
            req = self.turn_request(
                ids, request.sampling, request.routing, request.tenant, request.request_id, model=model, version=version
            )
            timeout = req.timeout = _time_left(deadline)
            session = Session()
            shadow = shadow_of(model, version)
            run = VersionRun(model, version, "primary", keep_text=shadow is not None, choices=req.sampling.n)
            with run:
                try:
                    async with aclosing(version.router.run_turn(req, session, None, admission)) as events:
                        async for event in events:
                            obs.record(event)
                            if run.see(event) and shadow is not None:  # every choice's Done came
                                copy = shadow_copy(req, timeout, event)
                                self._shadows.start(model, shadow, copy, run.output())
                            yield event
                finally:
                    await session.close()

    async def complete(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> tuple[Chunk, Done]:
        """:meth:`generate`'s events as one: all the output in one chunk, and the Done (one choice only:
        InvalidArgument for ``n`` > 1, whose choices only :meth:`generate` can tell apart)."""
        if request.sampling.n > 1:
            raise InvalidArgument(
                f"sampling.n is {request.sampling.n} but Complete returns one choice; use Generate for n > 1"
            )
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
        return Chunk(token_ids, "".join(texts), logprobs=tuple(logprobs)), done

    async def embed(self, query: EmbedQuery, *, deadline: float | None = None) -> Embeddings:
        """Embed ``query``'s inputs (texts tokenized here, no chat template) on a cloud replica
        (services/router/frontend/embeddings.py); token bounds are checked before any worker is called."""
        started = time.perf_counter()
        status = "INTERNAL"
        try:
            model = self.check_model(query.model)
            version = model.choose(query.tenant)
            tokenizer = version.router.tokenizer
            ids = [
                await self._encode(partial(tokenizer.encode, x), len(x)) if isinstance(x, str) else list(x)
                for x in query.inputs
            ]
            check_tokens(
                ids,
                context_length=model.context_length,
                vocab_size=tokenizer.vocab_size,
                max_total=self._max_embed_tokens,
            )
            result = await self._embed_route.embed(
                ids,
                dimensions=query.dimensions,
                request_id=query.request_id,
                time_left=_time_left(deadline),
                pool=version.router.healthy,
            )
            TOKENS.labels(SERVICE, TierName.CLOUD.value, "input").inc(result.prompt_tokens)
            status = "OK"
            return result
        except MeshError as exc:
            status = exc.code
            raise
        finally:
            REQUEST_DURATION.labels(SERVICE, TierName.CLOUD.value, status).observe(time.perf_counter() - started)

    def chat(self, *, tenant: str = "", request_id: str = "", deadline: float | None = None) -> ChatSession:
        """A chat session: send it turns, read its events (see :class:`ChatSession`)."""
        return ChatSession(self, tenant, request_id, deadline)

    # -- the parts of a request ------------------------------------------------------------------

    def turn_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        routing: Routing,
        tenant: str,
        request_id: str,
        *,
        model: ServedModel | None = None,
        version: ServedVersion | None = None,
    ) -> TurnRequest:
        """The turn to run: the one place a request's unset sampling fields get the model's generation
        defaults (``version``'s, else the model's primary's; services/common/generation_defaults.py), then
        ``max_tokens`` fitted to the context."""
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty; send at least one character of text")
        model = model or self.models.get("")
        defaults = version.defaults if version is not None else model.defaults
        sampling = defaults.apply(sampling).fit(
            len(prompt_ids),
            model.context_length,
            defaults.max_tokens or self._default_max_tokens,
            vocab_size=model.tokenizer.vocab_size,
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
            background=routing.background,
        )

    async def _encode(self, fn: Callable[[], list[int]], size: int) -> list[int]:
        with tracing.span("router.tokenize"):
            return await tokenize(fn, size)

    async def _encode_prompt(self, prompt: str, model: ServedModel) -> list[int]:
        encoded = self._encoded[model.id]
        ids = encoded.get(prompt)
        if ids is not None:
            return ids
        ids = await self._encode(partial(model.tokenizer.encode, prompt), len(prompt))
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            encoded.put(prompt, ids)
        return ids

    async def encode_chat(
        self,
        conversation: list[dict[str, Any]],
        model: ServedModel | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of ``conversation`` through ``model``'s chat template (default model: None), with
        ``tools`` rendered as the template renders them (services/common/chat_tools.py)."""
        tokenizer = (model or self.models.get("")).tokenizer
        size = sum(len(m["content"] or "") for m in conversation) + (len(json.dumps(tools)) if tools else 0)
        return await self._encode(partial(tokenizer.apply_chat_template, conversation, True, tools), size)


class ChatSession:
    """One chat (a ``ChatChannel``): :meth:`send` turns (and :meth:`cancel_turn`, :meth:`end`), read
    :meth:`events`.

    Turns are served one after the other on one worker stream, each over the whole conversation so
    far (the replies as the caller saw them, also of a cancelled turn; of a turn with n > 1 choices,
    choice 0's reply, as most servers keep it); later turns keep the first
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
        messages: list[dict[str, Any]] = []
        hint: TierName | None = None
        index = 0
        try:
            while (turn := await self._next()) is not None:
                with observe() as obs:
                    if index == 0:  # the chat's model and version, for all its turns
                        model = api.check_model(turn.model)
                        version = model.choose(self._tenant)
                    if not turn.messages:
                        raise InvalidArgument("a chat turn needs at least one message")
                    conversation = messages + [m.as_dict() for m in turn.messages]
                    choice = effective_choice(turn.tools, turn.tool_choice)
                    ids = await api.encode_chat(conversation, model, prompt_tools(turn.tools, choice))
                    sampling = constrained(turn.sampling, turn.tools, choice)
                    req = api.turn_request(
                        ids, sampling, turn.routing, self._tenant, self._request_id, model=model, version=version
                    )
                    req.timeout = _time_left(self._deadline)
                    req.tools_key = tools_key(turn.tools, choice)
                    if index == 0:
                        hint = req.hint
                    req.hint = hint  # later turns stay where the first one went
                    self._cancel = cancel = asyncio.Event()
                    reply = _Reply()
                    parser = None
                    if calls_possible(turn.tools, choice):
                        if sampling.n > 1:
                            raise InvalidArgument(
                                f"sampling.n is {sampling.n} but a turn whose tools may be called has one choice; "
                                "send n 1, or tool_choice 'none'"
                            )
                        named = choice.mode is ToolChoiceMode.FUNCTION
                        parser = ToolCallParser(
                            [choice.function_name] if named else [t.name for t in turn.tools],
                            parallel=choice.parallel,
                            bare_json=named or choice.mode is ToolChoiceMode.REQUIRED,
                        )
                    shadow = shadow_of(model, version)
                    kept = shadow is not None
                    with VersionRun(model, version, "primary", keep_text=kept, choices=req.sampling.n) as run:
                        timeout = req.timeout
                        async with aclosing(version.router.run_turn(req, session, cancel)) as events:
                            async for event in events:
                                obs.record(event)
                                if run.see(event) and shadow is not None and not cancel.is_set():
                                    # The copy's own stand-alone stream: the chat's worker stream (and
                                    # the KV it keeps for the next turn) is the primary's alone.
                                    copy = shadow_copy(req, timeout, event)
                                    api._shadows.start(model, shadow, copy, run.output())
                                if parser is not None:
                                    for parsed in _parsed(parser, event):
                                        reply.add(parsed)
                                        yield TurnEvent(index, parsed)
                                    continue
                                reply.add(event)
                                yield TurnEvent(index, event)
                    self._cancel = None
                    # The conversation keeps what the caller saw, also of a cancelled turn.
                    messages = [*conversation, reply.message()]
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


def _parsed(parser: ToolCallParser, event: Event) -> list[Event]:
    """``event`` with its text split into content and tool calls; a Done first flushes the parser and
    ends a turn that called tools with TOOL_CALLS (as OpenAI's ``finish_reason: "tool_calls"``)."""
    if isinstance(event, Chunk):
        content, deltas = parser.feed(event.text)
        return [Chunk(event.token_ids, content, deltas, event.index, event.logprobs)]
    content, deltas = parser.finish()
    out: list[Event] = [Chunk((), content, deltas)] if content or deltas else []
    if parser.calls and event.finish_reason in (FinishReason.STOP, FinishReason.STOP_STRING):
        event = replace(event, finish_reason=int(FinishReason.TOOL_CALLS))
    out.append(event)
    return out


class _Reply:
    """The assistant's answer as the caller saw it: content and calls, for the next turn's conversation."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]

    def add(self, event: Event) -> None:
        if isinstance(event, Chunk) and event.index == 0:  # n > 1: choice 0 is remembered
            self.text.append(event.text)
            for delta in event.tool_calls:
                self._delta(delta)

    def _delta(self, delta: ToolCallDelta) -> None:
        call = self.calls.setdefault(delta.index, ["", "", ""])
        call[0] = delta.id or call[0]
        call[1] = delta.name or call[1]
        call[2] += delta.arguments

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.calls:
            out["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in (self.calls[k] for k in sorted(self.calls))
            ]
        return out
