"""Coalesced streams through real processes: gateway → router → worker runtime (synthetic engine), Redis.

The synthetic engine produces tokens faster than any hop writes them, so the worker, the router
and the gateway all merge frames. Whatever got merged, each stream must carry exactly the tokens
and text the worker produces, numbered without gaps, with the final frame alone and last; and the
same request as a unary Complete (no streaming at all) must agree with it.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator

import grpc
import pytest

from benchmarks.gateway.relay import start_stack
from services.cli.client import MeshClient, sampling_params
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.processes import ServiceProcess
from services.common.tokenizer import Tokenizer
from services.local.mesh import DEV_API_KEY

TOKENS = 200
PROMPTS = [f"Stream number {i} tells a story about coalesced frames." for i in range(6)]


@pytest.fixture(scope="module")
async def stack() -> AsyncIterator[dict[str, ServiceProcess]]:
    with tempfile.TemporaryDirectory(prefix="meshserve-coalesce-") as tmp:
        procs = await start_stack(tmp, slots=16)
        try:
            yield procs
        finally:
            for name in ("gateway", "router", "worker", "redis"):
                await procs[name].stop()


def _request(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt,
        sampling=sampling_params(max_tokens=TOKENS, temperature=0.0),
        routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
    )


async def _direct(stub: worker_pb2_grpc.WorkerStub, ids: list[int]) -> tuple[list[int], str]:
    call = stub.Generate(metadata=(("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),), timeout=30)
    sampling = sampling_params(max_tokens=TOKENS, temperature=0.0)
    await call.write(worker_pb2.WorkerRequest(start=worker_pb2.WorkerStart(prompt_token_ids=ids, sampling=sampling)))
    tokens: list[int] = []
    text: list[str] = []
    try:
        while not (frame := await call.read()).HasField("final"):
            tokens.extend(frame.token_ids)
            text.append(frame.text)
        text.append(frame.text)
    finally:
        call.cancel()
    return tokens, "".join(text)


async def _streamed(client: MeshClient, prompt: str) -> list[pb.GenerateResponse]:
    return [f async for f in client.stub.Generate(_request(prompt), metadata=client.metadata, timeout=30)]


async def test_merged_streams_carry_exactly_the_workers_tokens_and_text(stack: dict[str, ServiceProcess]) -> None:
    tokenizer = Tokenizer(model_paths().hf_dir)
    async with (
        MeshClient(stack["gateway"].address, DEV_API_KEY) as client,
        grpc.aio.insecure_channel(stack["worker"].address) as channel,
    ):
        worker = worker_pb2_grpc.WorkerStub(channel)
        streams = await asyncio.gather(*(_streamed(client, p) for p in PROMPTS))  # concurrent: hops fall behind
        for prompt, frames in zip(PROMPTS, streams, strict=True):
            expected_ids, expected_text = await _direct(worker, tokenizer.encode(prompt))
            assert len(expected_ids) == TOKENS
            assert [t for f in frames for t in f.token_ids] == expected_ids
            assert "".join(f.text for f in frames) == expected_text
            assert [f.sequence for f in frames] == list(range(len(frames)))
            assert frames[-1].HasField("final") and not any(f.HasField("final") for f in frames[:-1])
            assert not frames[-1].token_ids  # the final frame is never merged with tokens
            assert frames[-1].final.usage.completion_tokens == TOKENS
            assert len({f.request_id for f in frames}) == 1
            unary = await client.stub.Complete(_request(prompt), metadata=client.metadata, timeout=30)
            assert (list(unary.token_ids), unary.text) == (expected_ids, expected_text)
