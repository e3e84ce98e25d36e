"""coalesced(): frames that waited for a slow writer are merged, nothing is lost, reordered or merged across a final."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.coalesce import coalesced
from tests.unit.common.frames import Frame, merge


async def source(frames: list[Frame], gaps: list[int]) -> AsyncIterator[Frame]:
    for i, frame in enumerate(frames):
        for _ in range(gaps[i % len(gaps)]):  # upstream latency, in loop passes
            await asyncio.sleep(0)
        yield Frame(list(frame.ids), frame.text, frame.final)


_FRAMES = st.lists(
    st.builds(Frame, st.lists(st.integers(0, 50_000), max_size=3), st.text(max_size=3), st.booleans()),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(
    frames=_FRAMES,
    gaps=st.lists(st.integers(0, 3), min_size=1),
    pauses=st.lists(st.integers(0, 6), min_size=1),
    inline=st.integers(0, 4),
)
def test_merged_stream_carries_the_same_tokens_and_text_and_keeps_finals_apart(
    frames: list[Frame], gaps: list[int], pauses: list[int], inline: int
) -> None:
    async def main() -> list[Frame]:
        out: list[Frame] = []
        async with aclosing(coalesced(source(frames, gaps), merge, inline=inline)) as merged:
            async for frame in merged:
                out.append(frame)
                for _ in range(pauses[len(out) % len(pauses)]):  # the write in flight
                    await asyncio.sleep(0)
        return out

    out = asyncio.run(main())
    assert [t for f in out for t in f.ids] == [t for f in frames for t in f.ids]
    assert "".join(f.text for f in out) == "".join(f.text for f in frames)
    # Finals come through one for one, in place: the token frames between two finals are merged only
    # among themselves.
    assert [f for f in out if f.final] == [f for f in frames if f.final]
    assert len(out) <= len(frames)
    runs_in = _token_runs(frames)
    runs_out = _token_runs(out)
    assert [sum(len(f.ids) for f in r) for r in runs_out] == [sum(len(f.ids) for f in r) for r in runs_in]


def _token_runs(frames: list[Frame]) -> list[list[Frame]]:
    runs: list[list[Frame]] = [[]]
    for f in frames:
        if f.final:
            runs.append([])
        else:
            runs[-1].append(f)
    return runs


async def _queued(upstream: asyncio.Queue[Frame | None]) -> AsyncIterator[Frame]:
    while (frame := await upstream.get()) is not None:
        yield frame


async def test_a_frame_that_is_alone_goes_out_at_once_and_waiting_ones_are_merged() -> None:
    upstream: asyncio.Queue[Frame | None] = asyncio.Queue()
    async with aclosing(coalesced(_queued(upstream), merge, inline=0)) as merged:
        upstream.put_nowait(Frame([1], "a"))
        assert await asyncio.wait_for(anext(merged), 5) == Frame([1], "a")  # nothing waited: not held back
        for i, text in ((2, "b"), (3, "c"), (4, "d")):  # arrive while the writer is busy with frame 1
            upstream.put_nowait(Frame([i], text))
        for _ in range(10):
            await asyncio.sleep(0)
        assert await anext(merged) == Frame([2, 3, 4], "bcd")
        upstream.put_nowait(Frame([], "", final=True))
        upstream.put_nowait(None)
        assert [f async for f in merged] == [Frame([], "", final=True)]


async def test_the_first_inline_frames_are_read_one_by_one_then_waiting_ones_are_merged() -> None:
    upstream: asyncio.Queue[Frame | None] = asyncio.Queue()
    for i in range(6):
        upstream.put_nowait(Frame([i], str(i)))
    upstream.put_nowait(None)
    async with aclosing(coalesced(_queued(upstream), merge, inline=2)) as merged:
        out = [f async for f in merged]
    assert out == [Frame([0], "0"), Frame([1], "1"), Frame([2, 3, 4, 5], "2345")]


async def test_an_upstream_error_comes_after_the_frames_before_it() -> None:
    async def failing() -> AsyncIterator[Frame]:
        yield Frame([1], "a")
        yield Frame([2], "b")
        raise RuntimeError("upstream broke")

    seen: list[Frame] = []
    with pytest.raises(RuntimeError, match="upstream broke"):
        async with aclosing(coalesced(failing(), merge, inline=1)) as merged:
            async for frame in merged:
                seen.append(frame)
    assert [t for f in seen for t in f.ids] == [1, 2]


@pytest.mark.parametrize("inline", [0, 3])
async def test_closing_early_stops_the_reader_and_runs_the_sources_cleanup(inline: int) -> None:
    cleaned = asyncio.Event()
    blocked = asyncio.Event()

    async def endless() -> AsyncIterator[Frame]:
        try:
            yield Frame([1], "a")
            blocked.set()
            await asyncio.Event().wait()  # an upstream that never sends again
            yield Frame([2], "b")  # pragma: no cover
        finally:
            cleaned.set()

    async with aclosing(coalesced(endless(), merge, inline=inline)) as merged:
        assert (await anext(merged)).ids == [1]
        if not inline:  # the reading task is already waiting upstream
            await asyncio.wait_for(blocked.wait(), 5)
    assert cleaned.is_set()


@pytest.mark.parametrize("inline", [0, 3])
async def test_a_cancelled_writer_cancels_the_reader(inline: int) -> None:
    cleaned = asyncio.Event()
    first = asyncio.Event()

    async def endless() -> AsyncIterator[Frame]:
        try:
            yield Frame([1], "a")
            await asyncio.Event().wait()
            yield Frame([2], "b")  # pragma: no cover
        finally:
            cleaned.set()

    async def write() -> None:
        async with aclosing(coalesced(endless(), merge, inline=inline)) as merged:
            async for _ in merged:
                first.set()

    task = asyncio.create_task(write())
    await asyncio.wait_for(first.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()
