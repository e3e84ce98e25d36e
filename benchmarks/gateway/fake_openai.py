"""A trivial, fast OpenAI-compatible backend: the same upstream for LiteLLM and for comparisons.

``python -m benchmarks.gateway.fake_openai`` serves ``POST /v1/chat/completions`` and ``/v1/completions``
(streaming SSE or not) and ``GET /v1/models`` on 127.0.0.1, answering at once with ``max_tokens``
chunks of the word "tok" — no model, so what a gateway in front of it adds is all that is measured.
Port from ``MESHSERVE_FAKE_OPENAI_PORT`` (default: a free one), printed as a ``service_started``
JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from aiohttp import web


def _chunk(chat: bool, text: str | None, finish: str | None = None) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        kind = "text_completion"
    return {"id": "fake-1", "object": kind, "created": int(time.time()), "model": "fake", "choices": [choice]}


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    chat = request.path.endswith("/chat/completions")
    n = max(1, int(body.get("max_tokens") or 16))
    usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
    if not body.get("stream"):
        text = " tok" * n
        message = {"role": "assistant", "content": text} if chat else None
        choice = {"index": 0, "finish_reason": "length", **({"message": message} if chat else {"text": text})}
        kind = "chat.completion" if chat else "text_completion"
        return web.json_response(
            {
                "id": "fake-1",
                "object": kind,
                "created": int(time.time()),
                "model": "fake",
                "choices": [choice],
                "usage": usage,
            }
        )
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(n):
        await response.write(f"data: {json.dumps(_chunk(chat, ' tok'))}\n\n".encode())
    end = _chunk(chat, None, "length") | {"usage": usage}
    await response.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())
    await response.write_eof()
    return response


async def models(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "bench"}]})


def build_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


async def _main() -> None:
    runner = web.AppRunner(build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", int(os.environ.get("MESHSERVE_FAKE_OPENAI_PORT", "0")))
    await site.start()
    print(json.dumps({"event": "service_started", "port": runner.addresses[0][1]}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(_main())
