"""The one error mapper and the internal-credential check, on a real grpc.aio server (port 0)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from services.common import errors
from services.common.config import ServiceSettings
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import RunningServer, start_server

ERRORS = {
    "invalid": (errors.InvalidArgument("prompt is empty; send a non-empty prompt"), grpc.StatusCode.INVALID_ARGUMENT),
    "notfound": (errors.NotFound("unknown model 'x'; call ListModels"), grpc.StatusCode.NOT_FOUND),
    "unauth": (errors.Unauthenticated("missing API key"), grpc.StatusCode.UNAUTHENTICATED),
    "denied": (errors.PermissionDenied("not allowed"), grpc.StatusCode.PERMISSION_DENIED),
    "precondition": (
        errors.FailedPrecondition("this worker keeps no shareable KV; ask a cloud worker with Redis"),
        grpc.StatusCode.FAILED_PRECONDITION,
    ),
    "exhausted": (errors.ResourceExhausted("queue full", retry_after_ms=250), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "unavailable": (errors.Unavailable("no healthy worker"), grpc.StatusCode.UNAVAILABLE),
    "waking": (errors.Unavailable("model 'a' is waking up", retry_after_ms=5000), grpc.StatusCode.UNAVAILABLE),
    "deadline": (errors.DeadlineExceeded("too slow"), grpc.StatusCode.DEADLINE_EXCEEDED),
    "cancelled": (errors.Cancelled("cancelled"), grpc.StatusCode.CANCELLED),
    "bug": (ZeroDivisionError("secret internal detail"), grpc.StatusCode.INTERNAL),
}


class Raising(inference_pb2_grpc.InferenceServicer):
    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        raise ERRORS[request.prompt][0]

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(sequence=0, text="partial")
        raise ERRORS[request.prompt][0]


async def _serve(internal: bool) -> RunningServer:
    settings = ServiceSettings(port=0, internal_token="s3cret", shutdown_grace_s=0)
    return await start_server(
        settings,
        lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(Raising(), s),
        ["meshserve.v1.Inference"],
        internal=internal,
    )


@pytest.fixture
async def stub() -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    server = await _serve(internal=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield inference_pb2_grpc.InferenceStub(channel)
    await server.stop()


@pytest.mark.parametrize("name", sorted(ERRORS))
async def test_unary_errors_map_to_status(stub: inference_pb2_grpc.InferenceStub, name: str) -> None:
    exc, code = ERRORS[name]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(pb.GenerateRequest(prompt=name))
    assert err.value.code() == code
    if code == grpc.StatusCode.INTERNAL:
        assert "secret" not in (err.value.details() or "")
        assert "internal error" in (err.value.details() or "")
    else:
        assert err.value.details() == str(exc)


@pytest.mark.parametrize("name", ["invalid", "exhausted", "bug"])
async def test_streaming_errors_map_to_status_after_frames(stub: inference_pb2_grpc.InferenceStub, name: str) -> None:
    frames = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for frame in stub.Generate(pb.GenerateRequest(prompt=name)):
            frames.append(frame)
    assert [f.text for f in frames] == ["partial"]
    assert err.value.code() == ERRORS[name][1]


async def test_resource_exhausted_carries_retry_after_trailer(stub: inference_pb2_grpc.InferenceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(pb.GenerateRequest(prompt="exhausted"))
    assert ("retry-after-ms", "250") in tuple(err.value.trailing_metadata() or ())


async def test_unavailable_carries_a_retry_after_trailer_only_when_it_advises_one(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(pb.GenerateRequest(prompt="waking"))
    assert ("retry-after-ms", "5000") in tuple(err.value.trailing_metadata() or ())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(pb.GenerateRequest(prompt="unavailable"))
    assert "retry-after-ms" not in dict(err.value.trailing_metadata() or ())


async def test_internal_service_refuses_calls_without_the_token() -> None:
    server = await _serve(internal=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for metadata in ((), (("x-meshserve-internal-token", "wrong"),)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Complete(pb.GenerateRequest(prompt="invalid"), metadata=metadata)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(pb.GenerateRequest(prompt="invalid"), metadata=metadata):
                        pass
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(
                    pb.GenerateRequest(prompt="invalid"), metadata=(("x-meshserve-internal-token", "s3cret"),)
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop()
