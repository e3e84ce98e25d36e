"""FrameProtocol: length-prefixed frames, however the bytes are cut (a recording transport, no network)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.muxwire import FrameProtocol, WireError, messages
from services.common.pb.meshserve.internal.v1 import worker_pb2


class Transport(asyncio.Transport):
    def __init__(self, protocol: FrameProtocol) -> None:
        super().__init__()
        self.written = bytearray()
        self._protocol = protocol
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True
        self._protocol.connection_lost(None)


def _connected(max_frame: int = 64) -> tuple[FrameProtocol, Transport]:
    protocol = FrameProtocol(max_frame)
    transport = Transport(protocol)
    protocol.connection_made(transport)
    return protocol, transport


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


async def test_frames_cut_anywhere_arrive_whole_and_in_order() -> None:
    protocol, _ = _connected()
    wire = _frame(b"first") + _frame(b"") + _frame(b"third frame")
    for i in range(len(wire)):  # one byte at a time: every cut point
        protocol.data_received(wire[i : i + 1])
    assert [await protocol.read() for _ in range(3)] == [b"first", b"", b"third frame"]


async def test_several_frames_in_one_read_and_a_reader_woken_by_them() -> None:
    protocol, _ = _connected()
    reader = asyncio.create_task(protocol.read())
    await asyncio.sleep(0)
    protocol.data_received(_frame(b"a") + _frame(b"bc") + _frame(b"d")[:3])
    assert await asyncio.wait_for(reader, 1) == b"a"
    assert await protocol.read() == b"bc"
    protocol.data_received(_frame(b"d")[3:])
    assert await protocol.read() == b"d"


async def test_write_prefixes_the_length() -> None:
    protocol, transport = _connected()
    protocol.write(b"hello")
    assert bytes(transport.written) == b"\x00\x00\x00\x05hello"


async def test_a_frame_over_the_limit_ends_the_connection_with_a_wire_error() -> None:
    protocol, transport = _connected(max_frame=8)
    protocol.data_received((9).to_bytes(4, "big"))
    assert transport.is_closing()
    assert isinstance(protocol.error, WireError)
    assert "over the 8-byte limit" in str(protocol.error)
    assert await protocol.read() is None


async def test_the_end_wakes_a_waiting_reader_and_writes_fail_after_it() -> None:
    protocol, _ = _connected()
    reader = asyncio.create_task(protocol.read())
    await asyncio.sleep(0)
    protocol.connection_lost(ConnectionResetError("reset by peer"))
    assert await asyncio.wait_for(reader, 1) is None
    assert isinstance(protocol.error, ConnectionResetError)
    with pytest.raises(ConnectionResetError):
        protocol.write(b"late")
    with pytest.raises(ConnectionResetError):
        await protocol.drain()


async def test_drain_waits_while_paused_until_resumed() -> None:
    protocol, _ = _connected()
    protocol.pause_writing()
    drain = asyncio.create_task(protocol.drain())
    await asyncio.sleep(0.01)
    assert not drain.done()
    protocol.resume_writing()
    await asyncio.wait_for(drain, 1)


async def test_messages_parse_frames_and_a_frame_that_does_not_parse_ends_the_connection() -> None:
    protocol, transport = _connected(max_frame=1024)
    good = worker_pb2.MuxRequest(frames=[worker_pb2.MuxUp(stream=7, half_close=True)]).SerializeToString()
    protocol.data_received(_frame(good) + _frame(b"\xff\xff not a message"))
    parsed = [m async for m in messages(protocol, worker_pb2.MuxRequest)]
    assert [m.frames[0].stream for m in parsed] == [7]
    assert transport.is_closing()
    assert str(protocol.error) == "a frame that is not a MuxRequest"
