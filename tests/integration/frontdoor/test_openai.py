"""The official `openai` client against Envoy's port: every endpoint and every error it maps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import grpc
import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client import REGISTRY

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.gateway.keystore import KeyStore
from tests.integration.frontdoor.conftest import API_KEY, LIMITED_KEY, MODEL, TINY_KEY, WORDS, FakeRouter, Stack

pytestmark = pytest.mark.integration
TEXT = "".join(WORDS)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


async def test_chat_completion(client: openai.AsyncOpenAI, router: FakeRouter) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == TEXT
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (7, 3, 10)
    turn = router.requests[-1].turn  # type: ignore[attr-defined]
    assert [(m.role, m.content) for m in turn.messages] == [("system", "Be brief."), ("user", "Say hello")]
    assert turn.sampling.max_tokens == 8 and turn.sampling.temperature == 0


async def test_chat_completion_streaming(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    deltas, finish, usage = [], None, None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(deltas) == TEXT
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == len(WORDS)


async def test_completions(client: openai.AsyncOpenAI, router: FakeRouter) -> None:
    reply = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, seed=3, stop=["\n"])
    assert reply.object == "text_completion"
    assert reply.choices[0].text == TEXT
    assert reply.usage is not None and reply.usage.total_tokens == 10
    request = router.requests[-1]
    assert isinstance(request, pb.GenerateRequest)
    assert (request.prompt, request.sampling.seed, list(request.sampling.stop)) == ("Once upon", 3, ["\n"])

    stream = await client.completions.create(model=MODEL, prompt="Once upon", stream=True)
    texts = [chunk.choices[0].text async for chunk in stream]
    assert "".join(texts) == TEXT


async def test_models(client: openai.AsyncOpenAI) -> None:
    models = [m async for m in client.models.list()]
    assert [m.id for m in models] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")


async def test_wrong_key_is_401(stack: Stack) -> None:
    async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            await bad.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"


async def test_exhausted_limit_is_429_with_retry_after(stack: Stack, redis_url: str) -> None:
    """The real Redis rate limiter of the gateway: tenant `tiny` may send one request a minute."""
    async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key=TINY_KEY, max_retries=0) as tiny:
        await tiny.completions.create(model=MODEL, prompt="first")
        with pytest.raises(openai.RateLimitError) as info:
            await tiny.completions.create(model=MODEL, prompt="second")
    assert info.value.status_code == 429
    assert int(info.value.response.headers["retry-after"]) >= 1


async def test_router_overload_is_429_with_retry_after_rounded_up(
    client: openai.AsyncOpenAI, router: FakeRouter
) -> None:
    router.mode = "exhausted"  # retry_after_ms=2300
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    assert info.value.response.headers["retry-after"] == "3"
    assert info.value.response.headers["retry-after-ms"] == "2300"


async def test_errors_keep_their_http_status(client: openai.AsyncOpenAI, router: FakeRouter) -> None:
    with pytest.raises(openai.BadRequestError):  # gateway validation
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):  # refused by the adapter, never forwarded
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, n=17)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="hi")
    router.mode = "unavailable"
    with pytest.raises(openai.InternalServerError) as info:
        await client.completions.create(model=MODEL, prompt="hi")
    assert info.value.status_code == 503


async def test_raw_http_errors_are_openai_json(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{stack.door.base_url}/chat/completions", data=b"{not json", headers=headers) as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with session.get(f"{stack.door.base_url}/nothing-here", headers=headers) as r:
            assert r.status == 404
            assert "error" in await r.json()


async def test_grpc_clients_enter_through_envoy_too(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.door.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        auth = (("authorization", f"Bearer {API_KEY}"),)
        models = await stub.ListModels(pb.ListModelsRequest(), metadata=auth)
        assert [m.id for m in models.models] == [MODEL]
        frames = [f async for f in stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=auth)]
        assert "".join(f.text for f in frames) == TEXT and frames[-1].HasField("final")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListModels(pb.ListModelsRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_client_disconnect_mid_stream_cancels_the_router_call(stack: Stack, router: FakeRouter) -> None:
    router.mode = "hang"
    body = {"model": MODEL, "prompt": "hi", "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as session:
        reply = await session.post(f"{stack.door.base_url}/completions", json=body, headers=headers)
        assert reply.status == 200
        assert (await reply.content.readline()).startswith(b"data: {")  # the first token arrived
        reply.close()  # hang up mid-stream: Envoy -> adapter -> gateway -> router must all let go
    await asyncio.wait_for(router.cancelled.wait(), 15)


async def test_a_key_without_the_inference_scope_is_403_but_may_list_models(stack: Stack, redis_url: str) -> None:
    """A stored key (real Redis key store) whose only scope is models:read."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        reader, _ = await KeyStore(client).create("acme", scopes=["models:read"])
    finally:
        await client.aclose()
    async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key=reader, max_retries=0) as limited:
        assert [m.id async for m in limited.models.list()] == [MODEL]
        with pytest.raises(openai.PermissionDeniedError) as info:
            await limited.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
        assert info.value.status_code == 403
        assert "inference scope" in info.value.message
        with pytest.raises(openai.PermissionDeniedError):
            await limited.completions.create(model=MODEL, prompt="hi", stream=True)


async def test_a_static_key_limited_to_models_is_403_for_another_and_lists_only_its_own(stack: Stack) -> None:
    """A static key's `:model|model` limit over HTTP: as a stored key's --models (OpenAI-shaped 403)."""
    async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key=LIMITED_KEY, max_retries=0) as limited:
        assert [m.id async for m in limited.models.list()] == []  # MODEL is not one of its models
        with pytest.raises(openai.PermissionDeniedError) as info:
            await limited.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
        assert info.value.status_code == 403
        assert "may use other-model" in info.value.message
        assert isinstance(info.value.body, dict) and info.value.body.get("type")  # the OpenAI error object
        with pytest.raises(openai.PermissionDeniedError):
            await limited.completions.create(model=MODEL, prompt="hi")


def _gateway_requests(status: str) -> float:
    labels = {"service": "gateway", "tier": "edge", "status": status}
    return REGISTRY.get_sample_value("meshserve_request_duration_seconds_count", labels) or 0.0


async def test_a_finished_chat_is_not_cancelled_on_its_way_out(client: openai.AsyncOpenAI, router: FakeRouter) -> None:
    """After the final frame the adapter lets the gateway end the Chat call instead of cancelling it.

    It cancelled at once: when the call had not ended yet (here the router ends it LINGER_S later; on
    the real mesh about one chat in four), the gateway recorded a complete answer as CANCELLED.
    """
    router.mode = "linger"
    ok, cancelled = _gateway_requests("OK"), _gateway_requests("CANCELLED")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello"}]
    reply = await client.chat.completions.create(model=MODEL, messages=messages)
    assert reply.choices[0].message.content == TEXT
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == TEXT
    assert not router.cancelled.is_set()
    assert _gateway_requests("CANCELLED") == cancelled
    assert _gateway_requests("OK") == ok + 2


async def test_stream_chunks_carry_null_usage_until_the_usage_chunk(stack: Stack) -> None:
    """OpenAI's framing with include_usage: every chunk has "usage" (null), the last one has the counts."""
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{stack.door.base_url}/chat/completions", json=body, headers=headers) as reply:
            assert reply.status == 200 and reply.headers["content-type"] == "text/event-stream"
            raw = (await reply.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(set(c) >= {"id", "object", "created", "model", "choices", "usage"} for c in chunks)
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 10
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        ({"seed": 2**64}, 400),  # was 500 (protobuf's range error)
        ({"max_tokens": 2**32}, 400),  # was 500
        ({"frequency_penalty": 2.5}, 400),  # out of range (the gateway refuses it)
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, 400),  # not a schema
        ({"frequency_penalty": 0, "presence_penalty": 0, "user": "u", "seed": -3, "top_k": 4}, 200),
    ],
)
async def test_sampling_fields_through_envoy(
    stack: Stack, router: FakeRouter, extra: dict[str, object], status: int
) -> None:
    body = {"model": MODEL, "messages": MESSAGES, **extra}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{stack.door.base_url}/chat/completions", json=body, headers=headers) as reply:
            assert reply.status == status
            answer = await reply.json()
    if status == 400:
        assert answer["error"]["type"] == "invalid_request_error"
        assert not router.requests  # refused by the adapter
    else:
        sampling = router.requests[-1].turn.sampling  # type: ignore[attr-defined]
        assert (sampling.seed, sampling.top_k) == (2**64 - 3, 4)


async def test_unreadable_bodies_are_400_through_envoy(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for data, more in ((b"[" * 20_000 + b"]" * 20_000, {}), (b"not gzip", {"Content-Encoding": "gzip"})):
            url = f"{stack.door.base_url}/chat/completions"
            async with session.post(url, data=data, headers={**headers, **more}) as reply:
                assert reply.status == 400  # both were 500
                assert (await reply.json())["error"]["type"] == "invalid_request_error"


async def _raw_http(address: str, request: bytes) -> tuple[int, dict[str, object]]:
    """Send bytes no HTTP client library would send; returns Envoy's status and JSON body."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower()
    return int(head.split()[1]), json.loads(body)


async def test_envoys_own_replies_are_openai_error_json(stack: Stack) -> None:
    """Replies Envoy makes itself (before any adapter sees the request) were text/plain."""
    big = b"x-big: " + b"a" * 70_000 + b"\r\n"  # over Envoy's 60 KiB of headers
    status, body = await _raw_http(stack.door.address, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + big + b"\r\n")
    assert status == 431 and body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    conflicting = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n"
    status, body = await _raw_http(stack.door.address, conflicting + b"0\r\n\r\n")
    assert status == 400 and body["error"]["message"]  # type: ignore[index]
    status, body = await _raw_http(stack.door.address, b"GET /nothing HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert status == 404 and body == {
        "error": {"message": "no such path; the API lives under /v1/", "type": "not_found_error"}
    }


async def test_every_answer_carries_the_request_id_header(client: openai.AsyncOpenAI) -> None:
    """The `openai` package reads x-request-id into `_request_id`; only streamed answers had it."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello"}]
    chat = await client.chat.completions.create(model=MODEL, messages=messages)
    assert chat._request_id and chat.id == f"chatcmpl-{chat._request_id}"
    completion = await client.completions.create(model=MODEL, prompt="Once upon")
    assert completion._request_id and completion.id == f"cmpl-{completion._request_id}"
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    assert stream.response.headers["x-request-id"]
    await stream.close()


async def test_replies_name_the_served_model_not_the_requests_empty_one(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(model="", messages=MESSAGES)  # type: ignore[arg-type]
    assert chat.model == MODEL
    stream = await client.chat.completions.create(
        model="",
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    assert {chunk.model async for chunk in stream} == {MODEL}
    completion = await client.completions.create(model="", prompt="Once upon")
    assert completion.model == MODEL
    chunks = await client.completions.create(model="", prompt="Once upon", stream=True)
    assert {chunk.model async for chunk in chunks} == {MODEL}


async def test_penalty_fields_reach_the_gateway(client: openai.AsyncOpenAI, router: FakeRouter) -> None:
    await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={"17": -100},
        extra_body={"repetition_penalty": 1.25, "min_tokens": 2},
    )
    sampling = router.requests[-1].turn.sampling  # type: ignore[attr-defined]
    assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.repetition_penalty) == (0.5, -0.5, 1.25)
    assert dict(sampling.logit_bias) == {17: -100.0} and sampling.min_tokens == 2
    await client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    # unset: the gateway sends it on unset, for the router to apply the model's default
    sampling = router.requests[-1].turn.sampling  # type: ignore[attr-defined]
    assert not any(sampling.HasField(f) for f in ("repetition_penalty", "temperature", "top_p", "top_k"))
