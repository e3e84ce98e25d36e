"""The official `openai` client through Envoy + the HTTP adapter in front of the real mesh's gateway.

The front door is attached to the session mesh (no second model load); ``meshserve up`` starts the
same :class:`FrontDoor` via ``MeshConfig(envoy=True)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.controlplane.frontdoor import FrontDoor
from services.local.mesh import Mesh
from tests.e2e.conftest import API_KEY, worker_stub

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "user", "content": "Name one colour of the sky."}]


@pytest.fixture
async def client(door: FrontDoor) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


async def test_models_then_chat_streaming_and_not_streaming_agree(client: openai.AsyncOpenAI) -> None:
    models = [m.id async for m in client.models.list()]
    assert len(models) == 1
    model = models[0]
    reply = await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    text = reply.choices[0].message.content
    assert text and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert 0 < reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    stream = await client.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    deltas, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(deltas) == text  # greedy: the same answer, streamed
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens


async def test_completions_streaming_and_not(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model="", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.choices[0].text and reply.usage is not None and reply.usage.completion_tokens <= 8
    stream = await client.completions.create(
        model="", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream]) == reply.choices[0].text


async def test_wrong_key_is_401(door: FrontDoor) -> None:
    async with openai.AsyncOpenAI(base_url=door.base_url, api_key="msk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="", messages=MESSAGES)  # type: ignore[arg-type]


async def _worker_totals(mesh: Mesh) -> tuple[int, int]:
    """(sequences cancelled, sequences active) summed over every worker of the mesh."""
    cancelled = active = 0
    for worker in [*mesh.workers("edge"), *mesh.workers("cloud")]:
        channel, stub = await worker_stub(worker.address)
        try:
            stats = await stub.Stats(
                worker_pb2.StatsRequest(), metadata=(("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)
            )
        finally:
            await channel.close()
        cancelled += stats.sequences_cancelled_total
        active += stats.active_sequences
    return cancelled, active


async def test_a_client_that_hangs_up_mid_stream_cancels_the_generation_on_the_worker(
    client: openai.AsyncOpenAI, mesh: Mesh
) -> None:
    """Envoy -> adapter -> gateway -> router -> worker: closing the HTTP stream stops the model.

    Greedy, this prompt runs to 300 tokens (checked once), so the stream is still generating when
    the client leaves after three chunks.
    """
    before, _ = await _worker_totals(mesh)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}
    ]
    stream = await client.chat.completions.create(
        model="",
        messages=messages,
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    received = 0
    async for chunk in stream:
        received += 1
        assert not chunk.choices or chunk.choices[0].finish_reason is None
        if received == 3:
            break
    await stream.close()
    cancelled, active = before, 1
    for _ in range(200):  # bounded: the worker must let go within ~10 s
        cancelled, active = await _worker_totals(mesh)
        if cancelled > before and active == 0:
            break
        await asyncio.sleep(0.05)
    assert (cancelled, active) == (before + 1, 0)
