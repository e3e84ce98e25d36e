"""The stream transport end to end over real TCP on 127.0.0.1: the worker's listener
(services/worker/mux_tcp.py) with a fake Generate, the router's StreamConnection
(services/router/balancer/stream_transport.py), and raw sockets that break the rules."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common import errors, muxwire
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.router.balancer.stream_transport import StreamConnection, split_host
from services.router.balancer.worker_stream import WorkerFailed
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


def _call(port: int, token: str = TOKEN) -> StreamConnection:
    return StreamConnection(("127.0.0.1", port), token, 1 << 16)


def _open(sid: int, n: int) -> worker_pb2.MuxRequest:
    """Open stream ``sid`` with one start and half-close it (its handler ends after that turn)."""
    opened = worker_pb2.MuxOpen(request_id=f"req-{sid}", tenant="acme")
    up = worker_pb2.MuxUp(stream=sid, open=opened, request=_start(n))
    return worker_pb2.MuxRequest(frames=[up, worker_pb2.MuxUp(stream=sid, half_close=True)])


async def _frames_of(call: StreamConnection, sid: int) -> list[worker_pb2.MuxDown]:
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
    call = _call(server.port)
    await call.write(_open(1, 3))
    frames = await asyncio.wait_for(_frames_of(call, 1), 5)
    assert [t for f in frames if f.HasField("response") for t in f.response.token_ids] == [30, 31, 32]
    assert frames[-2].response.final.completion_tokens == 3
    assert frames[-1].end.code == 0
    assert server.connections == 1
    call.cancel()


async def test_hanging_up_cancels_the_streams_on_the_worker(
    served: tuple[StreamMuxServer, FakeGenerate, MuxCalls],
) -> None:
    server, generate, _ = served
    call = _call(server.port)
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
    call = _call(server.port)
    await call.write(_open(1, 2))
    frames = await asyncio.wait_for(_frames_of(call, 1), 5)
    assert frames[-1].end.code == 0
    calls.drain()  # no stream left: the call (the connection) ends at once, without an error
    rest = [message async for message in call]
    assert rest == []


async def test_finish_cancels_what_runs_past_the_grace(served: tuple[StreamMuxServer, FakeGenerate, MuxCalls]) -> None:
    server, generate, _ = served
    call = _call(server.port)
    await call.write(_open(2, 103))
    await asyncio.wait_for(generate.started.wait(), 5)
    server.close(0.05)
    await asyncio.wait_for(server.finish(), 5)
    assert generate.closed == ["req-2"]
    with pytest.raises(WorkerFailed) as err:
        await call.write(_open(3, 1))
        async for _ in call:
            pass
    assert err.value.code == "UNAVAILABLE"


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


async def test_a_refused_credential_fails_the_connection_as_a_failed_worker(
    served: tuple[StreamMuxServer, FakeGenerate, MuxCalls],
) -> None:
    server, generate, _ = served
    call = _call(server.port, token="not the mesh's")
    with pytest.raises(WorkerFailed) as err:
        await call.write(_open(1, 1))
    assert err.value.code == "UNAVAILABLE" and "internal credential" in str(err.value)
    with pytest.raises(WorkerFailed):
        _ = [m async for m in call]
    assert isinstance(err.value.error, errors.Unavailable)
    assert not generate.started.is_set()
    call.cancel()


async def test_nothing_listening_fails_the_connection_as_a_failed_worker() -> None:
    port = free_port()
    call = _call(port)
    with pytest.raises(WorkerFailed) as err:
        await call.write(_open(1, 1))
    assert err.value.code == "UNAVAILABLE" and f"127.0.0.1:{port}" in str(err.value)


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
