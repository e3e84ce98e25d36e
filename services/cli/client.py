"""A tiny async client of the public gateway API, used by the CLI, the benchmarks and the tests.

    async with MeshClient("127.0.0.1:50051", api_key="...") as client:
        await client.wait_ready()
        answer = await client.generate("Hello", max_tokens=32, on_text=print)
        async with client.chat() as session:
            first = await session.turn("What is the capital of France?")
            second = await session.turn("And of Italy?")

It is a thin layer over the generated stubs: it adds the API key, builds requests from keyword
arguments and collects streamed frames into a :class:`Completion`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import metadata as md
from services.common.grpc_compat import patch_grpc_aio
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc

TIERS = {"auto": pb.TIER_AUTO, "edge": pb.TIER_EDGE, "cloud": pb.TIER_CLOUD}
TextCallback = Callable[[str], None]
Messages = str | Sequence[tuple[str, str]] | Sequence[pb.ChatMessage]


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """``authorization: Bearer <key>`` metadata (empty without a key)."""
    return ((md.AUTHORIZATION, f"Bearer {api_key}"),) if api_key else ()


def sampling_params(
    max_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
) -> pb.SamplingParams:
    """A SamplingParams message; None (and ``max_tokens`` 0, no stop strings) leaves a field unset, for the
    served model's generation default."""
    params = pb.SamplingParams(max_tokens=max_tokens, stop=stop)
    if temperature is not None:
        params.temperature = temperature
    if top_p is not None:
        params.top_p = top_p
    if top_k is not None:
        params.top_k = top_k
    if seed is not None:
        params.seed = seed
    return params


def routing_options(
    tier: str | int = "auto", cache_policy: int = pb.CACHE_POLICY_USE, priority: int = 0
) -> pb.RoutingOptions:
    """A RoutingOptions message; ``tier`` is "auto", "edge", "cloud" or a Tier value."""
    tier_value = TIERS[tier] if isinstance(tier, str) else tier
    return pb.RoutingOptions(
        tier=pb.Tier.ValueType(tier_value), cache_policy=pb.CachePolicy.ValueType(cache_policy), priority=priority
    )


@dataclass
class Completion:
    """A collected answer: text, token ids, the final frame and client-side timings."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: pb.Final | None = None
    request_id: str = ""
    frames: int = 0
    ttft_s: float | None = None
    duration_s: float = 0.0

    def describe_route(self) -> str:
        """One line for humans: where it ran, why, tokens and timings."""
        if self.final is None:
            return f"no final frame (request {self.request_id or '?'})"
        route, usage = self.final.route, self.final.usage
        tier = pb.Tier.Name(route.tier).removeprefix("TIER_").lower()
        where = "response cache" if route.cache_hit else (route.worker_id or "?")
        ttft = f"{self.ttft_s * 1000:.0f} ms" if self.ttft_s is not None else "-"
        return (
            f"[{tier} via {where}, reason={route.reason or '-'}, "
            f"finish={pb.FinishReason.Name(self.final.finish_reason).removeprefix('FINISH_REASON_').lower()}, "
            f"tokens {usage.prompt_tokens} in / {usage.completion_tokens} out, ttft {ttft}, "
            f"total {self.duration_s:.2f} s, request {self.request_id}]"
        )


class _Collector:
    """Accumulates frames (GenerateResponse or ChatResponse) into a Completion."""

    def __init__(self, on_text: TextCallback | None) -> None:
        self.result = Completion()
        self._on_text = on_text
        self._start = time.perf_counter()

    def add(self, frame: pb.GenerateResponse | pb.ChatResponse) -> bool:
        """Add one frame; True once the final frame arrived."""
        result = self.result
        now = time.perf_counter() - self._start
        if result.ttft_s is None and frame.token_ids:
            result.ttft_s = now
        result.frames += 1
        result.request_id = result.request_id or frame.request_id
        result.token_ids.extend(frame.token_ids)
        if frame.text:
            result.text += frame.text
            if self._on_text is not None:
                self._on_text(frame.text)
        result.duration_s = now
        if frame.HasField("final"):
            result.final = frame.final
            return True
        return False


class MeshClient:
    """Client of the gateway's `meshserve.v1.Inference`; use as ``async with``."""

    def __init__(self, address: str, api_key: str | None = None, *, channel: grpc.aio.Channel | None = None) -> None:
        patch_grpc_aio()  # a pipelined Chat frame must not hide the server's status (grpc#36066)
        self.address = address
        self._own_channel = channel is None
        self.channel = channel or grpc.aio.insecure_channel(address)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.metadata = auth_metadata(api_key)

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_channel:
            await self.channel.close()

    async def wait_ready(self, timeout_s: float = 30.0, service: str = "") -> None:
        """Wait until the server's gRPC health reports SERVING (raises TimeoutError)."""
        await wait_for_health(self.channel, timeout_s, service)

    def generate_call(
        self, request: pb.GenerateRequest, *, timeout_s: float | None = None
    ) -> grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]:
        """The raw streaming call (iterate it; ``cancel()`` it to stop early)."""
        return self.stub.Generate(request, metadata=self.metadata, timeout=timeout_s)

    async def generate(
        self,
        prompt: str,
        *,
        on_text: TextCallback | None = None,
        tier: str | int = "auto",
        cache_policy: int = pb.CACHE_POLICY_USE,
        model: str = "",
        timeout_s: float | None = None,
        **sampling: object,
    ) -> Completion:
        """Stream one prompt; ``on_text`` gets every text delta; ``sampling`` = :func:`sampling_params` args."""
        request = pb.GenerateRequest(
            model=model,
            prompt=prompt,
            sampling=sampling_params(**sampling),  # type: ignore[arg-type]
            routing=routing_options(tier, cache_policy),
        )
        collector = _Collector(on_text)
        call = self.generate_call(request, timeout_s=timeout_s)
        try:
            async for frame in call:
                collector.add(frame)
        finally:
            call.cancel()
        return collector.result

    async def complete(self, request: pb.GenerateRequest, *, timeout_s: float | None = None) -> pb.GenerateResponse:
        """The unary Complete call."""
        reply: pb.GenerateResponse = await self.stub.Complete(request, metadata=self.metadata, timeout=timeout_s)
        return reply

    async def list_models(self, *, timeout_s: float | None = 10.0) -> list[pb.ModelInfo]:
        reply = await self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata, timeout=timeout_s)
        return list(reply.models)

    def chat(self, *, timeout_s: float | None = None) -> ChatSession:
        """A Chat session on one bidirectional stream (``async with client.chat() as session``)."""
        return ChatSession(self, timeout_s)


class ChatSession:
    """One Chat stream: send turns one after another, cancel the turn in progress."""

    def __init__(self, client: MeshClient, timeout_s: float | None) -> None:
        self._outbox: asyncio.Queue[pb.ChatRequest | None] = asyncio.Queue()
        self.call = client.stub.Chat(self._requests(), metadata=client.metadata, timeout=timeout_s)
        self._frames = self.call.__aiter__()
        self.turns = 0

    async def _requests(self) -> AsyncIterator[pb.ChatRequest]:
        # The gateway sends its headers (x-request-id) once the caller is authenticated; writing
        # before that races a rejection, and grpc.aio then reports a failed write as
        # "INTERNAL: Internal error from Core" instead of the server's status (grpc/grpc#36066).
        await self.call.initial_metadata()
        if self.call.done():
            return
        while (item := await self._outbox.get()) is not None:
            yield item

    async def __aenter__(self) -> ChatSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def turn(
        self,
        messages: Messages,
        *,
        on_text: TextCallback | None = None,
        tier: str | int = "auto",
        model: str = "",
        **sampling: object,
    ) -> Completion:
        """Send a turn (a user message string, (role, content) pairs or ChatMessages); collect the answer."""
        self.send_turn(messages, tier=tier, model=model, **sampling)
        return await self.receive(on_text)

    def send_turn(self, messages: Messages, *, tier: str | int = "auto", model: str = "", **sampling: object) -> None:
        """Queue a turn without waiting for the answer (pair with :meth:`receive`)."""
        if isinstance(messages, str):
            chat = [pb.ChatMessage(role="user", content=messages)]
        else:
            chat = [m if isinstance(m, pb.ChatMessage) else pb.ChatMessage(role=m[0], content=m[1]) for m in messages]
        turn = pb.ChatTurn(
            messages=chat,
            sampling=sampling_params(**sampling),  # type: ignore[arg-type]
            routing=routing_options(tier),
            model=model,
        )
        self._outbox.put_nowait(pb.ChatRequest(turn=turn))
        self.turns += 1

    async def receive(self, on_text: TextCallback | None = None) -> Completion:
        """Frames of the current turn until its final frame."""
        collector = _Collector(on_text)
        while not collector.add(await self.next_frame()):
            pass
        return collector.result

    async def next_frame(self) -> pb.ChatResponse:
        """The next server frame (raises StopAsyncIteration when the server ended the stream)."""
        frame: pb.ChatResponse = await self._frames.__anext__()
        return frame

    def cancel(self) -> None:
        """Ask the server to stop the turn in progress (its final frame says CANCELLED)."""
        self._outbox.put_nowait(pb.ChatRequest(cancel=pb.Cancel()))

    async def close(self, drain_s: float = 5.0) -> None:
        """Half-close the stream, let the server end it (up to ``drain_s``), then end the call."""
        self._outbox.put_nowait(None)

        async def drain() -> None:
            async for _frame in self._frames:
                pass

        try:
            await asyncio.wait_for(drain(), drain_s)
        except (TimeoutError, grpc.aio.AioRpcError):
            pass
        finally:
            self.call.cancel()


async def wait_for_health(target: str | grpc.aio.Channel, timeout_s: float = 30.0, service: str = "") -> None:
    """Wait on gRPC health ``Watch`` until ``service`` is SERVING; raises TimeoutError after ``timeout_s``."""
    channel = grpc.aio.insecure_channel(target) if isinstance(target, str) else target
    stub = health_pb2_grpc.HealthStub(channel)

    async def watch() -> None:
        async for reply in stub.Watch(health_pb2.HealthCheckRequest(service=service), wait_for_ready=True):
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return

    try:
        await asyncio.wait_for(watch(), timeout_s)
    finally:
        if isinstance(target, str):
            await channel.close()


async def print_stream(
    address: str,
    api_key: str | None,
    prompt: str,
    *,
    max_tokens: int = 256,
    temperature: float | None = None,
    tier: str = "auto",
    system: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> Completion:
    """Ask ``prompt`` as a one-turn chat, printing the answer live to ``out``; route info to ``err``."""
    out, err = out or sys.stdout, err or sys.stderr

    def show(text: str) -> None:
        out.write(text)
        out.flush()

    messages = ([("system", system)] if system else []) + [("user", prompt)]
    async with MeshClient(address, api_key) as client, client.chat() as session:
        result = await session.turn(messages, on_text=show, tier=tier, max_tokens=max_tokens, temperature=temperature)
    out.write("\n")
    out.flush()
    err.write(result.describe_route() + "\n")
    err.flush()
    return result
