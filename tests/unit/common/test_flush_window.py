"""The flush window: while busy, a stream's token frames are spaced by it; first, final, errors, ends and lone
streams are never held; the tokens and text are the same, in order."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from services.common.coalesce import FlushWindow, coalesced
from services.common.config import StreamingSettings, load_settings
from services.common.errors import ConfigError
from tests.unit.common.frames import Frame, merge

LONG = 10.0  # a window no test waits out: a frame that comes out at all was not held by it


def is_final(frame: Frame) -> bool:
    return frame.final


def token(i: int) -> Frame:
    return Frame([i], f"t{i} ")


async def from_queue(inbox: asyncio.Queue[Frame | BaseException | None], closed: list[bool]) -> AsyncIterator[Frame]:
    """A source the test drives frame by frame; None ends it, an exception is raised from it."""
    try:
        while (item := await inbox.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        closed.append(True)


async def settle() -> None:
    for _ in range(20):  # loop passes (not wall time): every ready task gets to run
        await asyncio.sleep(0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_policy_holds_only_busy_streams_that_sent_a_frame_within_the_window() -> None:
    clock = FakeClock()
    window = FlushWindow(0.02, busy_streams=2, clock=clock)
    window.active = 1
    assert not window.busy and window.hold_s(clock.now) == 0.0  # a lone stream is never held
    window.active = 2
    assert window.busy
    assert window.hold_s(None) == 0.0  # the first frame of a stream
    assert window.hold_s(clock.now - 0.005) == pytest.approx(0.015)
    assert window.hold_s(clock.now - 0.02) == 0.0
    off = FlushWindow(0.0, busy_streams=1, clock=clock)
    off.active = 50
    assert not off.busy and off.hold_s(clock.now) == 0.0
    with pytest.raises(ValueError):
        FlushWindow(-1.0)
    with pytest.raises(ValueError):
        FlushWindow(0.02, busy_streams=0)


def test_settings_default_to_20_ms_from_8_streams_and_can_be_turned_off() -> None:
    window = StreamingSettings().flush_window()
    assert (window.window_s, window.busy_streams, window.enabled) == (0.02, 8, True)
    assert not StreamingSettings(flush_window_ms=0).flush_window().enabled
    with pytest.raises(ConfigError, match="flush_busy_streams"):
        load_settings(StreamingSettings, flush_busy_streams=0)


async def test_a_busy_stream_holds_token_frames_and_the_final_flushes_them_at_once() -> None:
    window = FlushWindow(LONG, busy_streams=1)
    inbox: asyncio.Queue[Frame | BaseException | None] = asyncio.Queue()
    closed: list[bool] = []
    async with aclosing(coalesced(from_queue(inbox, closed), merge, window=window, urgent=is_final)) as frames:
        inbox.put_nowait(token(0))
        assert await asyncio.wait_for(anext(frames), 5) == token(0)  # the first frame is never held
        pending = asyncio.ensure_future(anext(frames))
        for i in range(1, 4):
            inbox.put_nowait(token(i))
            await settle()
        assert not pending.done()  # held: the window since the first frame has not passed
        final = Frame([], "", final=True)
        inbox.put_nowait(final)
        assert await asyncio.wait_for(pending, 5) == Frame([1, 2, 3], "t1 t2 t3 ")
        assert await asyncio.wait_for(anext(frames), 5) == final
        inbox.put_nowait(None)
        assert [f async for f in frames] == []
    assert closed == [True] and window.active == 0


async def test_an_error_or_the_end_flushes_the_held_frame_before_it() -> None:
    for end in (RuntimeError("upstream failed"), None):
        window = FlushWindow(LONG, busy_streams=1)
        inbox: asyncio.Queue[Frame | BaseException | None] = asyncio.Queue()
        out: list[Frame] = []

        async def read(
            inbox: asyncio.Queue[Frame | BaseException | None], window: FlushWindow, out: list[Frame]
        ) -> None:
            async with aclosing(coalesced(from_queue(inbox, []), merge, window=window, urgent=is_final)) as frames:
                async for frame in frames:
                    out.append(frame)

        reader = asyncio.ensure_future(read(inbox, window, out))
        for i in range(3):
            inbox.put_nowait(token(i))
            await settle()
        inbox.put_nowait(end)
        if end is None:
            await asyncio.wait_for(reader, 5)
        else:
            with pytest.raises(RuntimeError, match="upstream failed"):
                await asyncio.wait_for(reader, 5)
        assert out == [token(0), Frame([1, 2], "t1 t2 ")]
        assert window.active == 0


async def test_closing_a_held_stream_returns_at_once_and_closes_the_source() -> None:
    window = FlushWindow(LONG, busy_streams=1)
    inbox: asyncio.Queue[Frame | BaseException | None] = asyncio.Queue()
    closed: list[bool] = []
    frames = coalesced(from_queue(inbox, closed), merge, window=window, urgent=is_final)
    inbox.put_nowait(token(0))
    await anext(frames)
    pending = asyncio.ensure_future(anext(frames))
    inbox.put_nowait(token(1))
    await settle()
    assert not pending.done()
    pending.cancel()  # the caller went away while the frame was held
    with pytest.raises(asyncio.CancelledError):
        await pending
    await asyncio.wait_for(frames.aclose(), 5)
    assert closed == [True] and window.active == 0


async def test_a_lone_stream_is_never_held() -> None:
    window = FlushWindow(LONG, busy_streams=2)
    inbox: asyncio.Queue[Frame | BaseException | None] = asyncio.Queue()
    async with aclosing(coalesced(from_queue(inbox, []), merge, window=window, urgent=is_final)) as frames:
        for i in range(8):
            inbox.put_nowait(token(i))
            assert await asyncio.wait_for(anext(frames), 5) == token(i)  # each at once, alone
        assert window.active == 1 and not window.busy


async def test_streams_count_as_open_and_busy_only_while_enough_are() -> None:
    window = FlushWindow(LONG, busy_streams=3)
    inboxes = [asyncio.Queue[Frame | BaseException | None]() for _ in range(3)]
    streams = [coalesced(from_queue(q, []), merge, window=window, urgent=is_final) for q in inboxes]
    for q, s in zip(inboxes, streams, strict=True):
        q.put_nowait(token(0))
        await anext(s)
    assert window.active == 3 and window.busy
    inboxes[0].put_nowait(token(1))
    held = asyncio.ensure_future(anext(streams[0]))
    await settle()
    assert not held.done()
    held.cancel()  # its caller goes away: the stream closes
    with pytest.raises(asyncio.CancelledError):
        await held
    assert window.active == 2 and not window.busy
    inboxes[1].put_nowait(token(1))  # one frame after another, but no longer busy: not held
    assert await asyncio.wait_for(anext(streams[1]), 5) == token(1)
    for s in streams:
        await s.aclose()
    assert window.active == 0


async def test_busy_token_frames_are_spaced_by_the_window_with_all_tokens_in_order() -> None:
    window_s = 0.03
    window = FlushWindow(window_s, busy_streams=1)

    async def paced() -> AsyncIterator[Frame]:
        for i in range(30):
            yield token(i)
            await asyncio.sleep(0.002)  # a token every 2 ms, like a fast decode
        yield Frame([], "", final=True)

    out: list[tuple[float, Frame]] = []
    async with aclosing(coalesced(paced(), merge, window=window, urgent=is_final)) as frames:
        async for frame in frames:
            out.append((time.monotonic(), frame))
    tokens = [(t, f) for t, f in out if not f.final]
    assert [i for _, f in tokens for i in f.ids] == list(range(30))
    assert "".join(f.text for _, f in tokens) == "".join(token(i).text for i in range(30))
    assert tokens[0][1] == token(0) and out[-1][1].final
    assert len(tokens) < 30  # merged
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(tokens)]
    # All but the last token frame, which the final flushed (receipt lags sending by microseconds).
    assert min(gaps[:-1]) >= window_s - 0.001


async def test_without_a_window_nothing_is_held_or_counted() -> None:
    window = FlushWindow(0.0, busy_streams=1)
    inbox: asyncio.Queue[Frame | BaseException | None] = asyncio.Queue()
    async with aclosing(coalesced(from_queue(inbox, []), merge, window=window)) as frames:
        for i in range(5):
            inbox.put_nowait(token(i))
            assert await asyncio.wait_for(anext(frames), 5) == token(i)
        assert window.active == 0
    with pytest.raises(ValueError, match="urgent"):
        coalesced(from_queue(inbox, []), merge, window=FlushWindow(0.02))
