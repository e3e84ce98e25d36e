"""Envoy + the HTTP adapter (real processes) in front of a real gateway and a fake router (in-process).

The fake router answers with fixed frames, or with the error its ``mode`` names, so every HTTP status
the front door maps can be produced without loading a model.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from services.common.config import ServiceSettings
from services.common.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import RunningServer, start_server
from services.controlplane.frontdoor import FrontDoor
from services.gateway.auth import hash_api_key
from services.gateway.config import GatewaySettings
from services.gateway.server import serve
from services.gateway.servicer import SERVICE_NAME
from tests.helpers import RedisServer

INTERNAL_TOKEN = "frontdoor-test-token"
API_KEY = "msk-frontdoor-test"
TINY_KEY = "msk-frontdoor-tiny"
"""Key of tenant ``tiny``, whose real (Redis) rate limit admits one request per minute."""
LIMITED_KEY = "msk-frontdoor-limited"
"""Static key of tenant ``acme`` limited to the model ``other-model`` (not :data:`MODEL`)."""
MODEL = "fake-model"
WORDS = ["Hello", ",", " world"]
LINGER_S = 0.3
"""How long a ``linger`` router takes to end a Chat call after the final frame (a slow close, not an error)."""


def sink(name: str, line: str) -> None:
    if '"level": "error"' in line or "Traceback" in line or "[error]" in line or "critical" in line:
        sys.stderr.write(f"{name} | {line}\n")


class FakeRouter(inference_pb2_grpc.InferenceServicer):
    """Streams WORDS then a final frame; ``mode`` makes it fail the way a router or limiter would."""

    def __init__(self) -> None:
        # ok | exhausted | unavailable | hang (one frame, then waits to be cancelled)
        # | linger (Chat: ends the call LINGER_S after a turn's final frame; a cancel meanwhile sets `cancelled`)
        self.mode = "ok"
        self.requests: list[object] = []
        self.cancelled = asyncio.Event()

    def _check(self, model: str) -> None:
        if model and model != MODEL:
            raise NotFound(f"unknown model {model!r}; ListModels shows the served models ({MODEL})")
        if self.mode == "exhausted":
            raise ResourceExhausted("rate limit of tenant 'acme' reached; retry later", retry_after_ms=2300)
        if self.mode == "unavailable":
            raise Unavailable("no healthy worker")

    @staticmethod
    def final() -> pb.Final:
        n = len(WORDS)
        return pb.Final(
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=7, completion_tokens=n, total_tokens=7 + n),
            route=pb.RouteInfo(tier=pb.TIER_EDGE, worker_id="edge-fake"),
        )

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        self._check(request.model)
        for i, word in enumerate(WORDS):
            yield pb.GenerateResponse(sequence=i, token_ids=[10 + i], text=word)
            if self.mode == "hang":
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
        yield pb.GenerateResponse(sequence=len(WORDS), final=self.final())

    async def Complete(self, request, context):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        self._check(request.model)
        return pb.GenerateResponse(token_ids=[10, 11, 12], text="".join(WORDS), final=self.final())

    async def ListModels(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=MODEL, tiers=[pb.TIER_EDGE], context_length=2048)])

    async def Chat(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for request in request_iterator:
            if request.WhichOneof("action") != "turn":
                continue
            self.requests.append(request)
            self._check(request.turn.model)
            if not request.turn.messages[-1].content:
                raise InvalidArgument("the last message is empty; send some text")
            for i, word in enumerate(WORDS):
                yield pb.ChatResponse(sequence=i, token_ids=[10 + i], text=word)
            yield pb.ChatResponse(sequence=len(WORDS), final=self.final())
            if self.mode == "linger":
                try:
                    await asyncio.sleep(LINGER_S)
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise


@dataclass
class Stack:
    router: FakeRouter
    servers: list[RunningServer]
    door: FrontDoor

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.servers[-1].port}"


async def start_gateway(router_port: int, redis_url: str = "") -> RunningServer:
    settings = GatewaySettings(
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        router_address=f"127.0.0.1:{router_port}",
        api_keys=(
            f"acme:{hash_api_key(API_KEY)},tiny:{hash_api_key(TINY_KEY)},acme:{hash_api_key(LIMITED_KEY)}:other-model"
        ),
        redis_url=redis_url,
        tenant_policies={"tiny": {"requests_per_minute": 1, "request_burst": 1, "batch_lines_in_flight": 3}},
        internal_token=INTERNAL_TOKEN,
        shutdown_grace_s=0.5,
    )
    return await serve(settings)


async def start_router(router: FakeRouter) -> RunningServer:
    settings = ServiceSettings(host="127.0.0.1", port=0, metrics_port=-1, internal_token=INTERNAL_TOKEN)
    return await start_server(
        settings,
        register=lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(router, s),
        service_names=[SERVICE_NAME],
        internal=True,
    )


@pytest.fixture(scope="module")
async def stack(redis_srv: RedisServer) -> AsyncIterator[Stack]:
    router = FakeRouter()
    router_server = await start_router(router)
    gateway_server = await start_gateway(router_server.port, redis_srv.url)
    servers = [router_server, gateway_server]
    try:
        async with FrontDoor([f"127.0.0.1:{gateway_server.port}"], sink) as door:
            yield Stack(router, servers, door)
    finally:
        for server in reversed(servers):
            await server.stop()


@pytest.fixture
async def router(stack: Stack) -> AsyncIterator[FakeRouter]:
    stack.router.mode = "ok"
    stack.router.requests.clear()
    stack.router.cancelled = asyncio.Event()
    yield stack.router
    stack.router.mode = "ok"


class NamedGateway(inference_pb2_grpc.InferenceServicer):
    """A stand-in gateway whose ListModels answers with its own name: shows which replica Envoy chose."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def ListModels(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=self.name)])


async def start_named_gateway(name: str) -> RunningServer:
    gateway = NamedGateway(name)
    return await start_server(
        ServiceSettings(host="127.0.0.1", port=0, metrics_port=-1, shutdown_grace_s=0.2),
        register=lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(gateway, s),
        service_names=[SERVICE_NAME],
    )
