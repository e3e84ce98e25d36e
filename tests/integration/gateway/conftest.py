"""A real gateway on port 0 in front of a fake router that records what reaches it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import grpc
import pytest

from services.cli.client import MeshClient, wait_for_health
from services.common.config import ServiceSettings
from services.common.errors import ResourceExhausted
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import RunningServer, start_server
from services.gateway.admission import Gate
from services.gateway.auth import hash_api_key
from services.gateway.config import GatewaySettings
from services.gateway.server import serve, start_gateway
from services.gateway.servicer import SERVICE_NAME

INTERNAL_TOKEN = "test-internal-token"
KEYS = {"acme": "key-acme-123", "globex": "key-globex-456"}
LIMITED_KEY = "key-limited-789"
"""A static key limited to the model ``other-model`` (the fake router serves ``fake-model``)."""
DEFAULT_DEADLINE_S = 42.0


@dataclass
class Seen:
    """What one call looked like at the router."""

    method: str
    metadata: dict[str, str]
    time_remaining: float | None
    request: object = None


@dataclass
class FakeRouter(inference_pb2_grpc.InferenceServicer):
    """Streams ``frames`` token frames then a final one; ``mode`` switches to errors or hanging."""

    seen: list[Seen] = field(default_factory=list)
    mode: str = "ok"  # ok | hang | exhausted | crash
    frames: int = 3
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    chat_requests: list[pb.ChatRequest] = field(default_factory=list)

    def reset(self) -> None:
        self.seen.clear()
        self.chat_requests.clear()
        self.mode, self.frames = "ok", 3
        self.cancelled = asyncio.Event()

    def _record(self, method: str, context: grpc.aio.ServicerContext, request: object = None) -> None:
        meta = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        self.seen.append(Seen(method, meta, context.time_remaining(), request))

    async def _misbehave(self) -> None:
        if self.mode == "exhausted":
            raise ResourceExhausted("all workers are busy; retry after the retry-after-ms delay", retry_after_ms=1234)
        if self.mode == "crash":
            raise RuntimeError("secret internal detail at worker 10.0.0.7")

    async def _hang(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Generate(self, request, context):
        self._record("Generate", context, request)
        await self._misbehave()
        for i in range(self.frames):
            yield pb.GenerateResponse(sequence=i, token_ids=[100 + i], text=f"w{i} ")
            if self.mode == "hang":
                await self._hang()
        yield pb.GenerateResponse(sequence=self.frames, final=_final(self.frames))

    async def Complete(self, request, context):
        self._record("Complete", context, request)
        await self._misbehave()
        return pb.GenerateResponse(token_ids=[1, 2], text="done", final=_final(2))

    async def ListModels(self, request, context):
        self._record("ListModels", context, request)
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="fake-model", tiers=[pb.TIER_EDGE])])

    async def Chat(self, request_iterator, context):
        self._record("Chat", context)
        turn = -1
        try:
            async for request in request_iterator:
                self.chat_requests.append(request)
                if request.WhichOneof("action") != "turn":
                    continue
                turn += 1
                if self.mode == "hang":
                    yield pb.ChatResponse(turn=turn, sequence=0, token_ids=[7], text="x")
                    await self._hang()
                for i in range(self.frames):
                    yield pb.ChatResponse(turn=turn, sequence=i, token_ids=[200 + i], text=f"c{i} ")
                yield pb.ChatResponse(turn=turn, sequence=self.frames, final=_final(self.frames))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def _final(completion_tokens: int) -> pb.Final:
    return pb.Final(
        finish_reason=pb.FINISH_REASON_LENGTH,
        usage=pb.Usage(prompt_tokens=5, completion_tokens=completion_tokens, total_tokens=5 + completion_tokens),
        route=pb.RouteInfo(tier=pb.TIER_EDGE, worker_id="edge-fake", reason="hint"),
    )


@dataclass
class Stack:
    router: FakeRouter
    router_server: RunningServer
    gateway_server: RunningServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway_server.port}"


def gateway_settings(router_address: str, **overrides: object) -> GatewaySettings:
    keys = ",".join(f"{tenant}:{hash_api_key(key)}" for tenant, key in KEYS.items())
    keys += f",limited:{hash_api_key(LIMITED_KEY)}:other-model"
    return GatewaySettings(
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        router_address=router_address,
        api_keys=keys,
        internal_token=INTERNAL_TOKEN,
        default_deadline_s=DEFAULT_DEADLINE_S,
        shutdown_grace_s=0.5,
        **overrides,
    )


@pytest.fixture(scope="module")
async def stack() -> AsyncIterator[Stack]:
    router = FakeRouter()
    router_settings = ServiceSettings(host="127.0.0.1", port=0, metrics_port=-1, internal_token=INTERNAL_TOKEN)
    router_server = await start_server(
        router_settings,
        register=lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(router, s),
        service_names=[SERVICE_NAME],
        internal=True,
    )
    gateway_server = await serve(gateway_settings(f"127.0.0.1:{router_server.port}"))
    try:
        await wait_for_health(f"127.0.0.1:{gateway_server.port}", 10.0, SERVICE_NAME)
        yield Stack(router, router_server, gateway_server)
    finally:
        await gateway_server.stop()
        await router_server.stop()


@pytest.fixture
async def router(stack: Stack) -> FakeRouter:
    stack.router.reset()
    return stack.router


@pytest.fixture
async def stub(stack: Stack) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(stack.address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[MeshClient]:
    async with MeshClient(stack.address, api_key=KEYS["acme"]) as mesh_client:
        yield mesh_client


@dataclass
class Gateways:
    router: FakeRouter
    servers: list[RunningServer]
    gates: list[Gate]
    stubs: list[inference_pb2_grpc.InferenceStub]
    redis_url: str


StartFn = Callable[..., Awaitable[Gateways]]


@pytest.fixture
async def start(redis_url: str) -> AsyncIterator[StartFn]:
    """``await start(replicas, **settings)``: a fake router and that many gateways on one Redis."""
    async with AsyncExitStack() as stack:

        async def _start(replicas: int = 1, url: str = redis_url, **overrides: object) -> Gateways:
            router = FakeRouter()
            router_server = await start_server(
                ServiceSettings(host="127.0.0.1", port=0, metrics_port=-1, internal_token=INTERNAL_TOKEN),
                register=lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(router, s),
                service_names=[SERVICE_NAME],
                internal=True,
            )
            stack.push_async_callback(router_server.stop)
            gateways = Gateways(router, [], [], [], url)
            for _ in range(replicas):
                settings = gateway_settings(f"127.0.0.1:{router_server.port}", redis_url=url, **overrides)
                server, gate = await start_gateway(settings)
                stack.push_async_callback(server.stop)
                address = f"127.0.0.1:{server.port}"
                await wait_for_health(address, 10.0, SERVICE_NAME)
                channel = grpc.aio.insecure_channel(address)
                stack.push_async_callback(channel.close)
                gateways.servers.append(server)
                gateways.gates.append(gate)
                gateways.stubs.append(inference_pb2_grpc.InferenceStub(channel))
            return gateways

        yield _start
