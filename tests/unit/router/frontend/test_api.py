"""RouterAPI, the router's transport-free surface: a domain request and its admission in, domain events out.

A real Router and tokenizer over one fake replica whose worker stream is scripted (no workers, no
network): what the worker is sent, and when, is what these tests look at. The real workers and the
gateway in front are in tests/integration/gateway/test_embedded_router.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from services.common.generation import FinishReason, GenerationEvent, GenerationRequest
from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer
from services.router.balancer.core import Router
from services.router.balancer.registry import Registry, Replica
from services.router.balancer.tiers import TierName
from services.router.frontend.api import RouterAPI
from services.router.tools import Tool, ToolChoice, ToolChoiceMode
from services.router.types import (
    ChatMessage,
    ChatTurn,
    Chunk,
    Done,
    Event,
    Generation,
    PendingAdmission,
    Route,
    Routing,
    TurnEvent,
)
from services.store.response_cache import ResponseCache
from tests.worker_helpers import worker_final, worker_frame

DEFAULT_MAX_TOKENS = 7
CONTEXT = 256


class FakeWorkerStream:
    """A worker stream whose frames the test sends (``frames``); records starts, cancels, aborts."""

    opened: list[FakeWorkerStream] = []

    def __init__(self, replica: Replica, timeout: float | None) -> None:
        self.replica = replica
        self.timeout = timeout
        self.starts: list[GenerationRequest] = []
        self.started = asyncio.Event()
        self.frames: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self.cancels = 0
        self.aborted = asyncio.Event()
        self.closed = False
        self.opened.append(self)

    async def start(self, start: GenerationRequest) -> None:
        self.starts.append(start)
        self.started.set()

    async def cancel_turn(self) -> None:
        self.cancels += 1
        self.frames.put_nowait(final(FinishReason.CANCELLED, 0))

    async def read(self) -> GenerationEvent:
        read = asyncio.ensure_future(self.frames.get())
        aborted = asyncio.ensure_future(self.aborted.wait())
        try:
            await asyncio.wait({read, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
        if self.aborted.is_set():  # what a cancelled gRPC call's read raises
            read.cancel()
            raise asyncio.CancelledError
        return read.result()

    def abort(self) -> None:
        self.aborted.set()

    async def close(self) -> None:
        self.closed = True

    def answer(self, *texts: str, finish: FinishReason = FinishReason.LENGTH) -> None:
        """The worker's frames of one turn: a token per text, then the final."""
        for i, text in enumerate(texts):
            self.frames.put_nowait(worker_frame(i, [100 + i], text))
        self.frames.put_nowait(final(finish, len(texts), sequence=len(texts)))


def final(finish: FinishReason, completion: int, sequence: int = 0) -> GenerationEvent:
    return worker_frame(sequence, [], "", final=worker_final(int(finish), 0, completion, 0))


class FakeTransport:
    """Opens a :class:`FakeWorkerStream` on any replica."""

    def open(self, replica: Replica, timeout: float | None) -> FakeWorkerStream:
        return FakeWorkerStream(replica, timeout)

    def retire(self, address: str) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.fixture
async def api(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RouterAPI]:
    FakeWorkerStream.opened = []
    cache = ResponseCache.from_url("")  # disabled: every request reaches the worker
    registry = Registry([], [], internal_token="t", block_tokens=16, model_version="v1")
    replica = Replica("edge:1", TierName.EDGE, None, None, healthy=True, worker_id="edge-a")  # type: ignore[arg-type]
    registry.replicas.append(replica)
    router = Router(
        tokenizer=tokenizer,
        cache=cache,
        registry=registry,
        model_id="m",
        model_version="v1",
        internal_token="t",
        edge_max_prompt_tokens=CONTEXT,
        transport=FakeTransport(),
    )
    yield RouterAPI(router, context_length=CONTEXT, default_max_tokens=DEFAULT_MAX_TOKENS, max_queued_chat_turns=2)
    await router.collapser.aclose()
    await cache.close()


def generation(prompt: str = "Hello there", **over: Any) -> Generation:
    args: dict[str, Any] = dict(
        prompt=prompt, sampling=SamplingParams(max_tokens=0), routing=Routing(use_cache=False), tenant="acme"
    )
    args.update(over)
    return Generation(**args)


async def worker() -> FakeWorkerStream:
    """The worker stream the router opened (once it has)."""
    for _ in range(100):
        if FakeWorkerStream.opened:
            return FakeWorkerStream.opened[-1]
        await asyncio.sleep(0)
    raise AssertionError("the router opened no worker stream")


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def collect(events: AsyncIterator[Event]) -> list[Event]:
    return [event async for event in events]


async def test_a_generation_streams_chunks_then_one_done(api: RouterAPI) -> None:
    request = generation(request_id="req-1")
    task = asyncio.create_task(collect(api.generate(request, deadline=time.monotonic() + 30)))
    stream = await worker()
    await stream.started.wait()
    stream.answer("a", "b")
    events = await task
    assert events[:2] == [Chunk([100], "a"), Chunk([101], "b")]
    (done,) = events[2:]
    assert isinstance(done, Done)
    assert done.finish_reason == FinishReason.LENGTH and done.completion_tokens == 2
    assert done.prompt_tokens == len(api.router.tokenizer.encode("Hello there"))
    assert done.route == Route(TierName.EDGE, "edge-a", False, done.route.reason)
    (start,) = stream.starts
    assert start.sampling.max_tokens == DEFAULT_MAX_TOKENS  # 0 asks for the router's default
    assert (start.request_id, start.tenant) == ("req-1", "acme")
    assert stream.timeout is not None and 29 < stream.timeout <= 30  # the deadline bounds the worker call


async def test_complete_is_the_stream_as_one(api: RouterAPI) -> None:
    task = asyncio.create_task(api.complete(generation()))
    (await worker()).answer("x", "y", finish=FinishReason.STOP)
    chunk, done = await task
    assert (list(chunk.token_ids), chunk.text) == ([100, 101], "xy")
    assert done.finish_reason == FinishReason.STOP


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (generation(model="other"), NotFound),
        (generation(prompt=""), InvalidArgument),
        (generation(sampling=SamplingParams(max_tokens=CONTEXT)), InvalidArgument),  # prompt + max_tokens > context
    ],
    ids=["unknown-model", "empty-prompt", "too-long"],
)
async def test_bad_requests_are_domain_errors_before_any_worker_call(
    api: RouterAPI, request_: Generation, error: type[Exception]
) -> None:
    with pytest.raises(error):
        await collect(api.generate(request_))
    assert FakeWorkerStream.opened == []


async def test_a_pending_admission_holds_the_worker_start_until_it_is_granted(api: RouterAPI) -> None:
    decision: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    events = api.generate(generation(), PendingAdmission(decision))
    first = asyncio.create_task(anext(events))
    stream = await worker()  # the replica is chosen and the stream opened meanwhile...
    await settle()
    assert stream.starts == [] and not first.done()  # ...but no work is sent before the decision
    decision.set_result(None)
    await stream.started.wait()
    stream.answer("a")
    assert await first == Chunk([100], "a")
    await events.aclose()


async def test_a_refused_admission_ends_the_stream_with_the_refusal_and_no_worker_start(api: RouterAPI) -> None:
    decision: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(collect(api.generate(generation(), PendingAdmission(decision))))
    stream = await worker()
    await settle()
    decision.set_exception(ResourceExhausted("rate limit reached; retry later", retry_after_ms=50))
    with pytest.raises(ResourceExhausted, match="rate limit"):
        await task
    assert stream.starts == []


async def test_a_speculative_start_runs_before_the_decision_and_a_refusal_aborts_it(api: RouterAPI) -> None:
    decision: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(collect(api.generate(generation(), PendingAdmission(decision, speculative=True))))
    stream = await worker()
    await asyncio.wait_for(stream.started.wait(), 5)  # started while the reservation is still running
    assert not decision.done()
    decision.set_exception(ResourceExhausted("rate limit reached; retry later", retry_after_ms=50))
    with pytest.raises(ResourceExhausted, match="rate limit"):  # the refusal, not a worker error
        await task
    assert stream.aborted.is_set()  # the worker's turn was aborted at once


async def test_a_granted_speculative_start_streams_as_usual(api: RouterAPI) -> None:
    decision: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(collect(api.generate(generation(), PendingAdmission(decision, speculative=True))))
    stream = await worker()
    await asyncio.wait_for(stream.started.wait(), 5)
    decision.set_result(None)
    stream.answer("a")
    assert [type(e) for e in await task] == [Chunk, Done]
    assert not stream.aborted.is_set()


async def test_a_decided_admission_never_starts_speculatively(api: RouterAPI) -> None:
    """A reservation known before the worker start is waited for (granted: nothing to wait; refused:
    no start at all), whatever ``speculative`` says."""
    refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    refused.set_exception(ResourceExhausted("rate limit reached; retry later"))
    with pytest.raises(ResourceExhausted):
        await collect(api.generate(generation(), PendingAdmission(refused, speculative=True)))
    assert all(s.starts == [] for s in FakeWorkerStream.opened)


async def test_closing_the_stream_aborts_the_worker(api: RouterAPI) -> None:
    events = api.generate(generation())
    first = asyncio.create_task(anext(events))
    stream = await worker()
    await stream.started.wait()
    stream.frames.put_nowait(worker_frame(0, [1], "a"))
    await first
    await events.aclose()  # the caller went away mid-answer
    assert stream.aborted.is_set()


def turn(text: str, **over: Any) -> ChatTurn:
    args: dict[str, Any] = dict(messages=(ChatMessage("user", text),), sampling=SamplingParams(max_tokens=0))
    args.update(over)
    return ChatTurn(**args)


async def test_chat_turns_share_one_worker_stream_and_the_conversation(api: RouterAPI) -> None:
    chat = api.chat(tenant="acme", request_id="c-1")
    events = chat.events()
    assert await chat.send(turn("Hi"))
    first = asyncio.create_task(anext(events))
    stream = await worker()
    await stream.started.wait()
    stream.answer("Hello")
    assert await first == TurnEvent(0, Chunk([100], "Hello"))
    assert isinstance((await anext(events)).event, Done)

    stream.started.clear()
    assert await chat.send(turn("More"))
    second = asyncio.create_task(anext(events))
    await stream.started.wait()
    await chat.cancel_turn()  # the worker is asked to end the turn; it still ends with a Done
    item = await second
    assert item.turn == 1 and isinstance(item.event, Done) and item.event.finish_reason == FinishReason.CANCELLED
    assert stream.cancels == 1 and len(FakeWorkerStream.opened) == 1
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]
    assert list(stream.starts[1].prompt_ids) == api.router.tokenizer.apply_chat_template(conversation)
    await chat.end()
    assert [e async for e in events] == []
    assert stream.closed


WEATHER = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}})


async def test_a_chat_turn_with_tools_streams_parsed_calls_and_the_next_turn_sees_them(api: RouterAPI) -> None:
    """Scripted output (the 135M model needs the schema constraint to call tools reliably)."""
    chat = api.chat(tenant="acme")
    events = chat.events()
    user = ChatMessage("user", "Weather in Paris?")
    assert await chat.send(turn("", messages=(user,), tools=(WEATHER,)))
    task = asyncio.create_task(anext(events))
    stream = await worker()
    await stream.started.wait()
    tools = [WEATHER.openai()]
    first_prompt = api.router.tokenizer.apply_chat_template([user.as_dict()], tools=tools)
    assert list(stream.starts[0].prompt_ids) == first_prompt
    stream.answer(
        "<tool_",
        'call>\n{"name": "get_weather", "arguments": {"ci',
        'ty": "Paris"}}\n</tool_call>',
        finish=FinishReason.STOP,
    )
    got = [(await task).event]
    while not isinstance(got[-1], Done):
        got.append((await anext(events)).event)
    chunks = [e for e in got if isinstance(e, Chunk)]
    assert "".join(c.text for c in chunks) == ""
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].index == 0 and deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")
    assert "".join(d.arguments for d in deltas) == '{"city": "Paris"}'
    assert [len(c.token_ids) for c in chunks] == [1, 1, 1]  # every token still reaches the caller
    assert isinstance(got[-1], Done) and got[-1].finish_reason == FinishReason.TOOL_CALLS

    stream.started.clear()
    result = ChatMessage("tool", "21 C", tool_call_id=deltas[0].id)
    assert await chat.send(turn("", messages=(result,), tools=(WEATHER,)))
    second = asyncio.create_task(anext(events))
    await stream.started.wait()
    call = {
        "id": deltas[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    conversation = [
        user.as_dict(),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21 C", "tool_call_id": deltas[0].id},
    ]
    assert list(stream.starts[1].prompt_ids) == api.router.tokenizer.apply_chat_template(conversation, tools=tools)
    stream.answer("It is 21 C.", finish=FinishReason.STOP)
    assert (await second).event == Chunk([100], "It is 21 C.", [])
    done = (await anext(events)).event
    assert isinstance(done, Done) and done.finish_reason == FinishReason.STOP
    await chat.end()


@pytest.mark.parametrize(
    ("pieces", "arguments"),
    [
        (['[{"name": "get_weather", "arguments": {"ci', 'ty": "Par'], ['{"city": "Par']),
        (['[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_w'], ['{"city": "Paris"}']),
        (
            ['[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather"'],
            ['{"city": "Paris"}', ""],
        ),
    ],
    ids=["in-arguments", "in-second-name", "after-second-name"],
)
async def test_a_call_cut_by_max_tokens_streams_as_calls_and_ends_with_length(
    api: RouterAPI, pieces: list[str], arguments: list[str]
) -> None:
    """The gRPC front door's events (the HTTP adapter's and Responses' come from them): the partial call
    as tool-call deltas, finish_reason LENGTH, no content."""
    chat = api.chat()
    events = chat.events()
    user = ChatMessage("user", "Weather in Paris?")
    required = ToolChoice(ToolChoiceMode.REQUIRED)
    assert await chat.send(turn("", messages=(user,), tools=(WEATHER,), tool_choice=required))
    task = asyncio.create_task(anext(events))
    stream = await worker()
    await stream.started.wait()
    stream.answer(*pieces, finish=FinishReason.LENGTH)
    got = [(await task).event]
    while not isinstance(got[-1], Done):
        got.append((await anext(events)).event)
    chunks = [e for e in got if isinstance(e, Chunk)]
    assert "".join(c.text for c in chunks) == ""
    calls: dict[int, str] = {}
    for d in (d for c in chunks for d in c.tool_calls):
        calls[d.index] = calls.get(d.index, "") + d.arguments
        assert d.name in ("", "get_weather")
    assert [calls[i] for i in sorted(calls)] == arguments
    assert isinstance(got[-1], Done) and got[-1].finish_reason == FinishReason.LENGTH
    await chat.end()


async def test_tool_choice_none_never_parses_calls_nor_renders_the_tools(api: RouterAPI) -> None:
    chat = api.chat()
    events = chat.events()
    user = ChatMessage("user", "Hi")
    assert await chat.send(turn("", messages=(user,), tools=(WEATHER,), tool_choice=ToolChoice(ToolChoiceMode.NONE)))
    task = asyncio.create_task(anext(events))
    stream = await worker()
    await stream.started.wait()
    assert list(stream.starts[0].prompt_ids) == api.router.tokenizer.apply_chat_template([user.as_dict()])
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    stream.answer(text, finish=FinishReason.STOP)
    assert (await task).event == Chunk([100], text)
    done = (await anext(events)).event
    assert isinstance(done, Done) and done.finish_reason == FinishReason.STOP
    await chat.end()


async def test_chat_turns_queued_beyond_the_limit_end_the_chat_after_the_turn_in_progress(api: RouterAPI) -> None:
    chat = api.chat()
    events = chat.events()
    await chat.send(turn("one"))
    first = asyncio.create_task(anext(events))
    stream = await worker()
    await stream.started.wait()
    assert await chat.send(turn("two")) and await chat.send(turn("three"))  # 2 queued: the limit
    assert not await chat.send(turn("four"))
    stream.answer("a")
    assert (await first).event == Chunk([100], "a")
    assert isinstance((await anext(events)).event, Done)  # the turn in progress finishes
    with pytest.raises(ResourceExhausted, match="more than 2 chat turns"):
        await anext(events)
    assert len(stream.starts) == 1  # no queued turn ran


async def test_a_chat_fails_where_its_bad_turn_would_have_been_served(api: RouterAPI) -> None:
    chat = api.chat()
    await chat.send(turn("one", model="other"))  # the first turn names the model
    async with aclosing(chat.events()) as events:
        with pytest.raises(NotFound):
            await anext(events)
    chat = api.chat()
    await chat.send(turn("one"))
    chat.fail(InvalidArgument("the second turn was bad"))
    async with aclosing(chat.events()) as events:
        first = asyncio.create_task(anext(events))
        stream = await worker()
        await stream.started.wait()
        stream.answer("a")
        assert (await first).turn == 0
        assert isinstance((await anext(events)).event, Done)  # the turn sent before it is served
        with pytest.raises(InvalidArgument, match="second turn"):
            await anext(events)


async def test_list_models(api: RouterAPI) -> None:
    (model,) = await api.list_models()
    assert (model.id, model.tiers, model.context_length) == ("m", (TierName.EDGE,), CONTEXT)
