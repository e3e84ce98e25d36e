"""Senders for :mod:`benchmarks.load.generator`: one request each, timed frame by frame.

* :func:`grpc_sender` — the public API through the gateway (``Generate`` for prompts, a one-turn
  ``Chat`` for conversations); the final frame's route says cache / tier / worker.
* :func:`http_sender` — any OpenAI-compatible server, streaming (SSE): meshserve's front door
  (Envoy → HTTP adapter → gateway), the naive transformers server, LiteLLM, the fake backend.
* :func:`worker_sender` — one worker over the internal API (no gateway, no router, no cache).

Errors become a :class:`~benchmarks.load.generator.Result` with the status name, never an exception.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import grpc

from benchmarks.load.generator import Result, Sender, WorkItem
from services.cli.client import TIERS, MeshClient, routing_options, sampling_params
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb

_TIER_NAMES = {pb.TIER_EDGE: "edge", pb.TIER_CLOUD: "cloud"}


def route_label(final: pb.Final | None) -> str:
    """ "cache" for a response-cache hit, else "<tier>/<worker id>"."""
    if final is None or not final.HasField("route"):
        return "unknown"
    if final.route.cache_hit:
        return "cache"
    return f"{_TIER_NAMES.get(final.route.tier, 'unknown')}/{final.route.worker_id or '?'}"


def _tick(result: Result, start: float, tokens: int) -> None:
    now = time.perf_counter() - start
    if result.ttft is None:
        result.ttft = now
    result.tokens += tokens
    result.token_times.append(now)


def grpc_sender(client: MeshClient, timeout_s: float = 60.0) -> Sender:
    """Requests through the gateway with ``client`` (its API key)."""

    async def send(item: WorkItem) -> Result:
        result = Result(item.kind)
        sampling = sampling_params(max_tokens=item.max_tokens, temperature=0.0)
        policy = pb.CACHE_POLICY_USE if item.cacheable else pb.CACHE_POLICY_BYPASS
        start = time.perf_counter()
        call: Any
        if item.kind == "chat":
            messages = [pb.ChatMessage(role=r, content=c) for r, c in item.messages]
            turn = pb.ChatTurn(messages=messages, sampling=sampling, routing=routing_options(item.tier, policy))
            call = client.stub.Chat(iter([pb.ChatRequest(turn=turn)]), metadata=client.metadata, timeout=timeout_s)
        else:
            request = pb.GenerateRequest(
                prompt=item.prompt, sampling=sampling, routing=routing_options(item.tier, policy)
            )
            call = client.stub.Generate(request, metadata=client.metadata, timeout=timeout_s)
        try:
            async for frame in call:
                if frame.token_ids:
                    _tick(result, start, len(frame.token_ids))
                if frame.HasField("final"):
                    result.route = route_label(frame.final)
                    break
        except grpc.aio.AioRpcError as exc:
            result.status = exc.code().name
        finally:
            call.cancel()
        result.total = time.perf_counter() - start
        return result

    return send


def http_sender(
    session: aiohttp.ClientSession, base_url: str, *, api_key: str = "", model: str = "", timeout_s: float = 60.0
) -> Sender:
    """Streaming OpenAI requests: ``/v1/completions`` for prompts, ``/v1/chat/completions`` for chats.

    Every SSE chunk with text counts as one token frame; the token count is the usage the server
    reports when it does (``stream_options.include_usage``), else the number of such chunks.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def send(item: WorkItem) -> Result:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": item.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if item.kind == "chat":
            path = "/v1/chat/completions"
            body["messages"] = [{"role": r, "content": c} for r, c in item.messages]
        else:
            path = "/v1/completions"
            body["prompt"] = item.prompt
        result = Result(item.kind)
        usage: int | None = None
        start = time.perf_counter()
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with session.post(base_url + path, json=body, headers=headers, timeout=timeout) as response:
                if response.status != 200:
                    result.status = f"HTTP {response.status}"
                    await response.read()
                else:
                    async for raw in response.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            result.status = f"SSE {chunk['error'].get('code') or 'error'}"
                            break
                        if chunk.get("usage"):
                            usage = int(chunk["usage"].get("completion_tokens", 0))
                        for choice in chunk.get("choices", ()):
                            text = choice.get("text") or (choice.get("delta") or {}).get("content")
                            if text:
                                _tick(result, start, 1)
        except (aiohttp.ClientError, TimeoutError) as exc:
            result.status = type(exc).__name__
        if usage is not None and result.status == "OK":
            result.tokens = usage
        result.total = time.perf_counter() - start
        return result

    return send


def worker_sender(
    stub: worker_pb2_grpc.WorkerStub, encode: Callable[[str], Sequence[int]], timeout_s: float = 60.0
) -> Sender:
    """Requests straight to one worker (internal credential); chats are sent as their joined text."""
    metadata = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN), ("x-meshserve-tenant", "bench"))

    async def send(item: WorkItem) -> Result:
        result = Result(item.kind, route="direct")
        start_msg = worker_pb2.WorkerRequest(
            start=worker_pb2.WorkerStart(
                request_id=f"bench-{time.perf_counter_ns()}",
                prompt_token_ids=list(encode(item.prompt)),
                sampling=sampling_params(max_tokens=item.max_tokens, temperature=0.0),
            )
        )
        start = time.perf_counter()
        call = stub.Generate(metadata=metadata, timeout=timeout_s)
        try:
            await call.write(start_msg)
            while True:
                frame = await call.read()
                if frame is grpc.aio.EOF:
                    break
                if frame.token_ids:
                    _tick(result, start, len(frame.token_ids))
                if frame.HasField("final"):
                    break
        except grpc.aio.AioRpcError as exc:
            result.status = exc.code().name
        finally:
            call.cancel()
        result.total = time.perf_counter() - start
        return result

    return send


__all__ = ["TIERS", "grpc_sender", "http_sender", "route_label", "worker_sender"]
