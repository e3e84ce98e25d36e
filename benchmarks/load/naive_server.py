"""Baseline: the server a user would write around transformers' ``generate`` — for comparison only.

``python -m benchmarks.load.naive_server`` loads the cloud checkpoint (``model_paths().hf_dir``) with
transformers and serves OpenAI-style streaming ``POST /v1/completions`` and ``/v1/chat/completions``
with aiohttp on 127.0.0.1 (port from ``MESHSERVE_NAIVE_PORT``, default any free one; printed as a
``service_started`` JSON line). Each request runs ``model.generate`` in its own thread with a
``TextIteratorStreamer``: no batching, no cache, no admission control — the usual first version.
Greedy only (``temperature`` is ignored), ``max_tokens`` honoured. Not part of meshserve.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import torch
from aiohttp import web
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

from services.common.model_paths import model_paths


def build_app(model: Any, tokenizer: Any) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if request.path.endswith("/chat/completions"):
            prompt = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        else:
            prompt = body["prompt"]
        inputs = tokenizer(prompt, return_tensors="pt")
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        max_new = int(body.get("max_tokens") or 16)
        counted: list[int] = []

        def work() -> None:
            with torch.inference_mode():
                out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, streamer=streamer)
            counted.append(int(out.shape[1] - inputs["input_ids"].shape[1]))

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chat = "messages" in body
        created = int(time.time())
        iterator = iter(streamer)
        while True:
            text = await asyncio.to_thread(next, iterator, None)
            if text is None:
                break
            if text:
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                await response.write(f"data: {json.dumps({'created': created, 'choices': [choice]})}\n\n".encode())
        await asyncio.to_thread(thread.join)
        usage = {"completion_tokens": counted[0] if counted else 0}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    return app


async def _main() -> None:
    torch.set_num_threads(int(os.environ.get("MESHSERVE_NAIVE_THREADS", "2")))
    hf_dir = model_paths().hf_dir
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    runner = web.AppRunner(build_app(model, tokenizer))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", int(os.environ.get("MESHSERVE_NAIVE_PORT", "0")))
    await site.start()
    port = runner.addresses[0][1]
    print(json.dumps({"event": "service_started", "port": port}), flush=True)
    try:
        await asyncio.Event().wait()  # until SIGTERM ends the process
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(_main())
