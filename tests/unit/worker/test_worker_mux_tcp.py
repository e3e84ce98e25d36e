"""The stream transport end to end over real TCP on 127.0.0.1: the worker's listener
(services/worker/mux_tcp.py) with a fake Generate, the router's StreamMuxCall
(services/router/mux_tcp.py), and raw sockets that break the rules."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common import muxwire
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.router.mux_tcp import StreamMuxCall, split_host
from services.worker import mux_tcp
from services.worker.mux import MuxCalls
from services.worker.mux_tcp import StreamMuxServer
from tests.helpers import free_port
from tests.unit.worker.test_worker_mux import FakeGenerate, _start

TOKEN = "mesh-token"


@pytest.fixture
async def served() -> AsyncIterator[tuple[StreamMuxServer, FakeGenerate, MuxCalls]]:
    generate, calls = FakeGenerate(), MuxCalls()
    server = StreamMuxServer(generate, calls, TOKEN, max_frame=1 << 16)  # type: ignore[arg-type]
    await server.start("127.0.0.1", 0)
    yield server, generate, calls
    server.close(0.0)
    await server.finish()


class FakeGrpcCall:
    """Stands in for the gRPC GenerateMux call a refused StreamMuxCall falls back to."""

    def __init__(self) -> None:
        self.written: list[worker_pb2.MuxRequest] = []
        self.cancelled = False

    async def write(self, message: worker_pb2.MuxRequest) -> None:
        self.written.append(message)

    def __aiter__(self) -> AsyncIterator[worker_pb2.MuxResponse]:
        return self._replies()

    async def _replies(self) -> AsyncIterator[worker_pb2.MuxResponse]:
        yield worker_pb2.MuxResponse(frames=[worker_pb2.MuxDown(stream=1, end=worker_pb2.MuxEnd())])

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def _call(port: int, token: str = TOKEN) -> tuple[StreamMuxCall, list[tuple[str, int]], list[FakeGrpcCall]]:
    refused: list[tuple[str, int]] = []
    fallbacks: list[FakeGrpcCall] = []

    def fallback() -> FakeGrpcCall:
        fallbacks.append(FakeGrpcCall())
        return fallbacks[-1]

    call = StreamMuxCall(("127.0.0.1", port), token, 1 << 16, fallback, refused.append)  # type: ignore[arg-type]
    return call, refused, fallbacks


def _open(sid: int, n: int) -> worker_pb2.MuxRequest:
    """Open stream ``sid`` with one start and half-close it (its handler ends after that turn)."""
    opened = worker_pb2.MuxOpen(request_id=f"req-{sid}", tenant="acme")
    up = worker_pb2.MuxUp(stream=sid, open=opened, request=_start(n))
    return worker_pb2.MuxRequest(frames=[up, worker_pb2.MuxUp(stream=sid, half_close=True)])


async def _frames_of(call: StreamMuxCall, sid: int) -> list[worker_pb2.MuxDown]:
    frames: list[worker_pb2.MuxDown] = []
    async for message in call:
        frames += [down for down in message.frames if down.stream == sid]
        if frames and frames[-1].HasField("end"):
            return frames
    return frames


async def _raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    size = int.from_bytes(await reader.readexactly(4), "big")
    return await reader.readexactly(size)


async def test_a_stream_runs_over_the_connection(served: tuple[StreamMuxServer, FakeGenerate, MuxCalls]) -> None:
    server, _, _ = served
    call, refused, fallbacks = _call(server.port)
    await call.write(_open(1, 3))
    frames = await asyncio.wait_for(_frames_of(call, 1), 5)
    assert [t for f in frames if f.HasField("response") for t in f.response.token_ids] == [30, 31, 32]
    assert frames[-2].response.final.completion_tokens == 3
    assert frames[-1].end.code == 0
    assert refused == [] and fallbacks == []
    assert server.connections == 1
    call.cancel()


async def test_hanging_up_cancels_the_streams_on_the_worker(
    served: tuple[StreamMuxServer, FakeGenerate, MuxCalls],
) -> None:
    server, generate, _ = served
    call, _, _ = _call(server.port)
    await call.write(_open(7, 103))  # runs until cancelled
    await asyncio.wait_for(generate.started.wait(), 5)
    call.cancel()
    for _ in range(200):
        if generate.closed:
            break
        await asyncio.sleep(0.01)
    assert generate.closed == ["req-7"]


async def test_a_draining_worker_ends_the_connection_cleanly(
    served: tuple[StreamMuxServer, FakeGenerate, MuxCalls],
) -> None:
    server, _, calls = served
    call, _, _ = _call(server.port)
    await call.write(_open(1, 2))
    frames = await asyncio.wait_for(_frames_of(call, 1), 5)
    assert frames[-1].end.code == 0
    calls.drain()  # no stream left: the call (the connection) ends at once, without an error
    rest = [message async for message in call]
    assert rest == []


async def test_finish_cancels_what_runs_past_the_grace(served: tuple[StreamMuxServer, FakeGenerate, MuxCalls]) -> None:
    server, generate, _ = served
    call, _, _ = _call(server.port)
    await call.write(_open(2, 103))
    await asyncio.wait_for(generate.started.wait(), 5)
    server.close(0.05)
    await asyncio.wait_for(server.finish(), 5)
    assert generate.closed == ["req-2"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.write(_open(3, 1))
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_wrong_credential_is_refused_with_a_reason(
    served: tuple[StreamMuxServer, FakeGenerate, MuxCalls],
) -> None:
    server, generate, _ = served
    reader, writer = await _raw(server.port)
    writer.write(_frame(muxwire.MAGIC + b"guess"))
    writer.write(_frame(_open(1, 1).SerializeToString()))  # pipelined: never served
    answer = await asyncio.wait_for(_read_frame(reader), 5)
    assert b"internal credential" in answer
    assert await asyncio.wait_for(reader.read(), 5) == b""  # then the worker closes
    assert not generate.started.is_set()
    writer.close()


async def test_the_router_falls_back_to_grpc_when_refused(
    served: tuple[StreamMuxServer, FakeGenerate, MuxCalls],
) -> None:
    server, generate, _ = served
    call, refused, fallbacks = _call(server.port, token="not the mesh's")
    await call.write(_open(1, 1))
    replies = [m async for m in call]
    assert replies[0].frames[0].end.code == 0  # the fallback call's reply
    assert refused == [("127.0.0.1", server.port)]
    assert len(fallbacks) == 1 and len(fallbacks[0].written) == 1
    assert not generate.started.is_set()
    call.cancel()
    assert fallbacks[0].cancelled


async def test_the_router_falls_back_to_grpc_when_nothing_listens() -> None:
    port = free_port()
    call, refused, fallbacks = _call(port)
    await call.write(_open(1, 1))
    assert refused == [("127.0.0.1", port)] and len(fallbacks) == 1


async def test_no_hello_in_time_closes_the_connection(
    served: tuple[StreamMuxServer, FakeGenerate, MuxCalls], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _, _ = served
    monkeypatch.setattr(mux_tcp, "HELLO_TIMEOUT_S", 0.1)
    reader, writer = await _raw(server.port)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


@pytest.mark.parametrize(
    "after_hello",
    [_frame(b"\xff\xff not a MuxRequest"), (1 << 20).to_bytes(4, "big")],
    ids=["garbage", "over-the-limit"],
)
async def test_a_broken_frame_ends_the_connection(
    served: tuple[StreamMuxServer, FakeGenerate, MuxCalls], after_hello: bytes
) -> None:
    server, generate, _ = served
    reader, writer = await _raw(server.port)
    writer.write(_frame(muxwire.MAGIC + TOKEN.encode()))
    assert await asyncio.wait_for(_read_frame(reader), 5) == b""  # accepted
    writer.write(after_hello)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # then closed for the broken frame
    assert not generate.started.is_set()
    writer.close()


def test_split_host() -> None:
    assert split_host("10.0.0.7:7101") == "10.0.0.7"
    assert split_host("[::1]:7101") == "::1"
    assert split_host("worker-0.mesh:7101") == "worker-0.mesh"
