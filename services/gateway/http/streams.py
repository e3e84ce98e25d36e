"""The adapter's stream plumbing, shared by its routes: the gateway's frames of one gRPC call (a chat
turn or a Generate) as plain tuples, and server-sent events out.

Streams: the first frame is awaited *before* the SSE headers go out (:func:`first_frame`), so an error
the gateway reports up front still gets its real HTTP status.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from aiohttp import web

from services.common import metadata as md
from services.common.errors import MeshError
from services.common.pb.meshserve.v1 import inference_pb2 as pb

_DONE = b"data: [DONE]\n\n"
CHAT_END_WAIT_S = 1.0
"""After a chat turn's final frame, how long the adapter waits for the gateway to end the call itself."""

Frame = tuple[str, pb.Final | None, Sequence[pb.ToolCallDelta], int, Sequence[pb.TokenLogprob]]
"""A frame's text, its final (on a choice's last frame), its tool-call deltas (chat only), the choice
index, and its tokens' logprobs (empty unless asked for)."""


async def chat_frames(call: Any, n: int = 1) -> AsyncIterator[Frame]:
    """The frames of the one turn (of ``n`` choices); after its last final frame, lets the call end
    before returning.

    The adapter has half-closed the call, so the gateway ends it right after the final frame.
    Cancelling it at once instead raced that end, and the gateway then recorded (metrics, logs)
    about one chat in four as CANCELLED although the caller got the whole answer.
    """
    left = n
    async for frame in call:
        final = frame.final if frame.HasField("final") else None
        yield frame.text, final, frame.tool_calls, frame.index, frame.logprobs
        if final is not None:
            left -= 1
            if left == 0:
                break
    try:
        async with asyncio.timeout(CHAT_END_WAIT_S):
            async for _ in call:
                pass
    except (TimeoutError, grpc.aio.AioRpcError):
        pass  # the answer is complete: the caller's finally cancels whatever is left


async def generate_frames(call: Any, request_ids: list[str]) -> AsyncIterator[Frame]:
    """Frames of a Generate call; the request id the frames carry is appended to ``request_ids``."""
    async for frame in call:
        if not request_ids and frame.request_id:
            request_ids.append(frame.request_id)
        yield frame.text, frame.final if frame.HasField("final") else None, (), frame.index, frame.logprobs


async def first_frame(frames: AsyncIterator[Frame]) -> Frame | None:
    """The first frame (raising the gateway's error, if any, before anything was sent)."""
    try:
        return await anext(frames)
    except StopAsyncIteration:
        return None


async def prepend(first: Frame | None, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
    if first is not None:
        yield first
        async for frame in frames:
            yield frame


async def collect(
    first: Frame | None, frames: AsyncIterator[Frame], n: int = 1
) -> tuple[list[str], list[pb.Final], list[list[pb.ToolCallDelta]], list[list[pb.TokenLogprob]]]:
    """Each choice's whole text, final frame, tool-call deltas and logprobs, by choice index."""
    parts: list[list[str]] = [[] for _ in range(n)]
    calls: list[list[pb.ToolCallDelta]] = [[] for _ in range(n)]
    logprobs: list[list[pb.TokenLogprob]] = [[] for _ in range(n)]
    finals: list[pb.Final | None] = [None] * n
    async for text, last, deltas, index, entries in prepend(first, frames):
        if not 0 <= index < n:
            raise MeshError(f"the gateway sent choice {index} of {n}; retry, and report it if it persists")
        parts[index].append(text)
        calls[index].extend(deltas)
        logprobs[index].extend(entries)
        if last is not None:
            finals[index] = last
    done = [f for f in finals if f is not None]
    if len(done) < n:
        raise MeshError("the stream ended without a final frame; retry, and report it if it persists")
    return ["".join(p) for p in parts], done, calls, logprobs


def header(metadata: Any, name: str) -> str | None:
    """The value of ``name`` in a call's initial or trailing metadata (None: absent)."""
    for key, value in metadata or ():
        if key == name:
            return str(value)
    return None


async def request_id(call: Any) -> str:
    """The request id the gateway sent in the call's initial metadata ("" if none)."""
    return header(await call.initial_metadata(), md.REQUEST_ID) or ""


async def sse_start(request: web.Request, request_id: str) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            md.REQUEST_ID: request_id,
        }
    )
    await response.prepare(request)
    return response


async def sse(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def sse_end(response: web.StreamResponse) -> web.StreamResponse:
    await response.write(_DONE)
    await response.write_eof()
    return response
