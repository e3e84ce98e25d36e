"""A gateway calling a router in another process (services/gateway/remote_router.py) passes on the router's
UNAVAILABLE with a retry-after (a model waking up): its message, naming the model, and its delay. Real gRPC on
port 0, a stand-in router servicer behind the real error interceptor."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from services.common import errors
from services.common.config import ServiceSettings
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.sampling import SamplingParams
from services.common.serving import start_server
from services.gateway.remote_router import RemoteRouter
from services.router.types import Generation

WAKING = "model 'tiny' is waking up and did not become ready within 60 s; retry after 5 s"


class Waking(inference_pb2_grpc.InferenceServicer):
    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        raise errors.Unavailable(WAKING, retry_after_ms=5000)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        raise errors.Unavailable(WAKING, retry_after_ms=5000)
        yield pb.GenerateResponse()


@pytest.fixture
async def remote() -> AsyncIterator[RemoteRouter]:
    settings = ServiceSettings(port=0, internal_token="t", shutdown_grace_s=0)
    servicer = Waking()  # type: ignore[abstract]
    server = await start_server(
        settings, lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, s), ["meshserve.v1.Inference"]
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield RemoteRouter(inference_pb2_grpc.InferenceStub(channel), "t")
    await server.stop()


def _generation() -> Generation:
    return Generation(prompt="hi", sampling=SamplingParams(max_tokens=2))


async def test_a_remote_routers_waking_unavailable_keeps_message_and_retry_after(remote: RemoteRouter) -> None:
    with pytest.raises(errors.Unavailable) as caught:
        await remote.complete(_generation())
    assert caught.value.message == WAKING and caught.value.retry_after_ms == 5000
    with pytest.raises(errors.Unavailable) as streamed:
        async for _ in remote.generate(_generation()):
            pass
    assert streamed.value.message == WAKING and streamed.value.retry_after_ms == 5000
