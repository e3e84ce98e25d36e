"""Embeddings and the Responses API on the real model: the public gRPC ``Embed`` (gateway -> router -> the
cloud worker) and, through Envoy with the official ``openai`` client, ``/v1/embeddings`` and ``/v1/responses``
(the adapter's response store in the session's Redis)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np
import openai
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.controlplane.frontdoor import FrontDoor
from services.local.mesh import Mesh
from tests.e2e.conftest import API_KEY, _sink, auth

pytestmark = pytest.mark.e2e
TEXTS = ["The sea is blue.", "A quick brown fox jumps over the lazy dog near the river bank.", "Hello"]


@pytest.fixture(scope="module")
async def door(mesh: Mesh) -> AsyncIterator[FrontDoor]:
    env = {"MESHSERVE_GATEWAY_HTTP_REDIS_URL": mesh.redis_url}
    async with FrontDoor([mesh.gateway_address], _sink, env=env) as running:
        yield running


@pytest.fixture
async def client(door: FrontDoor) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def embed_request(*inputs: str | list[int], dimensions: int = 0) -> pb.EmbedRequest:
    items = [pb.EmbedInput(text=x) if isinstance(x, str) else pb.EmbedInput(token_ids=x) for x in inputs]
    return pb.EmbedRequest(inputs=items, dimensions=dimensions)


async def test_grpc_embed_batch_equals_one_by_one(gateway) -> None:  # type: ignore[no-untyped-def]
    reply = await gateway.Embed(embed_request(*TEXTS), metadata=auth())
    batch = np.array([e.values for e in reply.embeddings])
    assert batch.shape == (len(TEXTS), 576)  # SmolLM2-135M's hidden size
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert reply.route.tier == pb.TIER_CLOUD and reply.route.worker_id
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS)
    alone = []
    tokens = 0
    for text in TEXTS:
        one = await gateway.Embed(embed_request(text), metadata=auth())
        alone.append(one.embeddings[0].values)
        tokens += one.usage.prompt_tokens
    np.testing.assert_allclose(batch, np.array(alone), atol=1e-4)
    assert tokens == reply.usage.prompt_tokens
    # Different texts point different ways; the same text the same way.
    assert float(batch[0] @ batch[1]) < 0.999
    short = await gateway.Embed(embed_request(TEXTS[0], dimensions=64), metadata=auth())
    vector = np.array(short.embeddings[0].values)
    assert vector.shape == (64,)
    np.testing.assert_allclose(vector, batch[0, :64] / np.linalg.norm(batch[0, :64]), atol=1e-4)


async def test_grpc_embed_bounds_are_invalid_argument(gateway) -> None:  # type: ignore[no-untyped-def]
    cases = [
        (embed_request(), "inputs is empty"),
        (pb.EmbedRequest(inputs=[pb.EmbedInput()]), "inputs[0] must set exactly one"),
        (embed_request("x", [1, 2**31]), "outside the model's vocabulary"),
        (embed_request("word " * 6000), "inputs[0] is about"),  # the tenant's max_prompt_tokens (8192), per input
        (embed_request("x", dimensions=9999), "dimensions is 9999"),
    ]
    for request, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await gateway.Embed(request, metadata=auth())
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert message in (caught.value.details() or "")


async def test_openai_embeddings_float_base64_and_batch(client: openai.AsyncOpenAI) -> None:
    as_float = await client.embeddings.create(model="", input=TEXTS, encoding_format="float")
    as_base64 = await client.embeddings.create(model="", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in as_float.data] == [0, 1, 2]
    floats = np.array([d.embedding for d in as_float.data])
    np.testing.assert_array_equal(floats.astype(np.float32), np.array([d.embedding for d in as_base64.data]))
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens > 0
    assert as_float.model  # the served model's id
    one = await client.embeddings.create(model="", input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(np.array(one.data[0].embedding), floats[1], atol=1e-4)
    short = await client.embeddings.create(model="", input=TEXTS[0], dimensions=32)
    assert len(short.data[0].embedding) == 32
    # Token ids in, the same vector as the text they encode.
    ids = await client.embeddings.create(model="", input=[[19556]], encoding_format="float")
    hello = await client.embeddings.create(model="", input="Hello", encoding_format="float")
    if ids.usage.prompt_tokens == hello.usage.prompt_tokens:
        np.testing.assert_allclose(ids.data[0].embedding, hello.data[0].embedding, atol=1e-5)


async def test_openai_responses_plain_stream_and_chain(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(
        model="", instructions="Answer in a few words.", input="Name a colour.", max_output_tokens=8, temperature=0
    )
    assert first.output_text and first.usage is not None and 0 < first.usage.output_tokens <= 8
    stream = await client.responses.create(
        model="",
        instructions="Answer in a few words.",
        input="Name a colour.",
        max_output_tokens=8,
        temperature=0,
        stream=True,
    )
    events = [event async for event in stream]
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == first.output_text  # greedy: the same answer, streamed
    second = await client.responses.create(
        model="", input="Name another.", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    assert second.output_text and second.usage is not None
    # The chain's history counts in its prompt.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


async def test_openai_responses_json_schema_and_tool_calls(client: openai.AsyncOpenAI) -> None:
    """Structured output and a required tool call on the real model (the output held to the schema), then the
    call's result in the next turn by previous_response_id."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    fmt = {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}
    reply = await client.responses.create(
        model="",
        input="Name a colour.",
        text={"format": fmt},
        max_output_tokens=24,
        temperature=0,  # type: ignore[typeddict-item]
    )
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), schema)

    ask = {"model": "", "input": "What is the weather in Paris?", "tools": [WEATHER], "max_output_tokens": 48}
    first = await client.responses.create(**ask, tool_choice="required", temperature=0)  # type: ignore[call-overload]
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    stream = await client.responses.create(**ask, tool_choice="required", temperature=0, stream=True)  # type: ignore[call-overload]
    events = [event async for event in stream]
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]  # greedy: the same calls

    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"} for c in calls]
    second = await client.responses.create(
        **ask | {"input": outputs}, tool_choice="none", previous_response_id=first.id, temperature=0
    )
    assert second.output_text and [item.type for item in second.output] == ["message"]
    # The chain is the conversation sent whole: the same prompt.
    spelled = [
        {"role": "user", "content": ask["input"]},
        *({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls),
        *outputs,
    ]
    whole = await client.responses.create(**ask | {"input": spelled}, tool_choice="none", temperature=0, store=False)
    assert second.usage is not None and whole.usage is not None
    assert second.usage.input_tokens == whole.usage.input_tokens and whole.output_text == second.output_text
