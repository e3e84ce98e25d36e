"""The real gateway on port 0 in front of a fake router: auth, validation, relay, deadlines, cancel."""

from __future__ import annotations

import asyncio
import sys
from asyncio.subprocess import PIPE

import grpc
import pytest
from prometheus_client import REGISTRY

from services.cli.client import MeshClient, auth_metadata
from services.common import metadata as md
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.config import GatewaySettings
from services.gateway.server import serve
from tests.helpers import free_port
from tests.integration.gateway.conftest import (
    DEFAULT_DEADLINE_S,
    INTERNAL_TOKEN,
    KEYS,
    FakeRouter,
    Stack,
    gateway_settings,
)

pytestmark = pytest.mark.integration


def request(prompt: str = "hello", **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(**sampling))  # type: ignore[arg-type]


async def drain(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    return [frame async for frame in call]


async def expect_status(call, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if hasattr(call, "__aiter__"):
            await drain(call)
        else:
            await call
    assert err.value.code() == code, err.value.details()
    details = err.value.details() or ""
    assert details and "\n" not in details and "Traceback" not in details
    return err.value


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        ((md.API_KEY, "wrong"),),
        ((md.AUTHORIZATION, "Bearer wrong"),),
        ((md.AUTHORIZATION, f"Basic {KEYS['acme']}"),),
    ],
    ids=["missing", "wrong-x-api-key", "wrong-bearer", "not-bearer"],
)
async def test_missing_or_wrong_key_is_unauthenticated_and_never_reaches_router(stub, router, metadata) -> None:
    await expect_status(stub.Generate(request(), metadata=metadata), grpc.StatusCode.UNAUTHENTICATED)
    await expect_status(stub.Complete(request(), metadata=metadata), grpc.StatusCode.UNAUTHENTICATED)
    await expect_status(stub.ListModels(pb.ListModelsRequest(), metadata=metadata), grpc.StatusCode.UNAUTHENTICATED)
    assert router.seen == []
    rejected = REGISTRY.get_sample_value(
        "meshserve_request_duration_seconds_count",
        {"service": "gateway", "tier": "unknown", "status": "UNAUTHENTICATED"},
    )
    assert rejected and rejected >= 3


@pytest.mark.parametrize("header", [md.AUTHORIZATION, md.API_KEY])
async def test_stream_is_relayed_with_request_id_tenant_and_internal_token(stub, router, header) -> None:
    value = f"Bearer {KEYS['globex']}" if header == md.AUTHORIZATION else KEYS["globex"]
    spoofed = ((md.TENANT, "acme"), (md.REQUEST_ID, "client-chosen"), (md.INTERNAL_TOKEN, "guess"))
    call = stub.Generate(request(), metadata=((header, value), *spoofed))
    frames = await drain(call)
    # Token frames that waited for the writer may be merged: same tokens and text, numbered without gaps.
    assert "".join(f.text for f in frames) == "w0 w1 w2 " and frames[-1].text == ""
    assert [t for f in frames for t in f.token_ids] == [100, 101, 102]
    assert [f.sequence for f in frames] == list(range(len(frames))) and 2 <= len(frames) <= 4
    assert frames[-1].final.route.worker_id == "edge-fake"
    (seen,) = router.seen
    assert seen.metadata[md.TENANT] == "globex", "the tenant comes from the key, never from the caller"
    assert seen.metadata[md.INTERNAL_TOKEN] == INTERNAL_TOKEN
    request_id = seen.metadata[md.REQUEST_ID]
    assert len(request_id) == 32 and request_id != "client-chosen"
    assert dict(await call.trailing_metadata())[md.REQUEST_ID] == request_id
    assert {f.request_id for f in frames} == {request_id}


async def test_complete_and_list_models_are_relayed(client: MeshClient, router) -> None:
    reply = await client.complete(request())
    assert reply.text == "done" and reply.final.usage.completion_tokens == 2 and reply.request_id
    assert [m.id for m in await client.list_models()] == ["fake-model"]
    assert [s.method for s in router.seen] == ["Complete", "ListModels"]
    assert all(s.metadata[md.TENANT] == "acme" for s in router.seen)


@pytest.mark.parametrize(
    "bad",
    [
        request(""),
        request("   \n"),
        request("x" * 40_000),
        request(max_tokens=1_000_000),
        request(temperature=2.5),
        request(temperature=-0.1),
        request(top_p=1.5),
        request(stop=[f"s{i}" for i in range(9)]),
        request(stop=[""]),
        pb.GenerateRequest(prompt="hi", routing=pb.RoutingOptions(priority=10)),
    ],
    ids=["empty", "blank", "too-long", "max-tokens", "temp-high", "temp-neg", "top-p", "stops", "empty-stop", "prio"],
)
async def test_invalid_requests_are_rejected_before_the_router(stub, router, bad) -> None:
    meta = auth_metadata(KEYS["acme"])
    await expect_status(stub.Generate(bad, metadata=meta), grpc.StatusCode.INVALID_ARGUMENT)
    await expect_status(stub.Complete(bad, metadata=meta), grpc.StatusCode.INVALID_ARGUMENT)
    assert router.seen == []


async def test_caller_deadline_is_propagated(stub, router) -> None:
    await drain(stub.Generate(request(), metadata=auth_metadata(KEYS["acme"]), timeout=5.0))
    remaining = router.seen[0].time_remaining
    assert remaining is not None and 3.0 < remaining <= 5.5


async def test_default_deadline_applies_when_caller_sets_none(stub, router) -> None:
    await drain(stub.Generate(request(), metadata=auth_metadata(KEYS["acme"])))
    remaining = router.seen[0].time_remaining
    assert remaining is not None and DEFAULT_DEADLINE_S - 3 < remaining <= DEFAULT_DEADLINE_S + 0.5


async def test_chat_session_gets_its_own_default_deadline(client: MeshClient, router: FakeRouter) -> None:
    """A whole Chat session without a deadline gets ``default_chat_deadline_s`` (900 s), not the
    Generate cap (600 s): it was capped at ``max_deadline_s``, so no chat could outlive 10 minutes."""
    default_chat, generate_cap = _default("default_chat_deadline_s"), _default("max_deadline_s")
    async with client.chat() as session:
        await session.turn("hi", max_tokens=2)
    remaining = router.seen[0].time_remaining
    assert default_chat > generate_cap
    assert remaining is not None and default_chat - 5 < remaining <= _rounded_up(default_chat)


async def test_chat_caller_deadline_is_capped_by_the_chat_cap(client: MeshClient, router: FakeRouter) -> None:
    chat_cap = _default("max_chat_deadline_s")
    async with client.chat(timeout_s=1200.0) as session:  # above the Generate cap, under the chat cap
        await session.turn("hi", max_tokens=2)
    remaining = router.seen[0].time_remaining
    assert remaining is not None and 1195.0 < remaining <= _rounded_up(1200.0)
    router.reset()
    async with client.chat(timeout_s=chat_cap * 2) as session:
        await session.turn("hi", max_tokens=2)
    remaining = router.seen[0].time_remaining
    assert remaining is not None and chat_cap - 5 < remaining <= _rounded_up(chat_cap)


def _rounded_up(seconds: float) -> float:
    """The most a deadline of ``seconds`` can read after the trip: gRPC's timeout header rounds long
    timeouts up, by up to about 1 % (900 s arrived as ~901 s, 1,200 s as ~1,210 s, 3,600 s as ~3,610 s)."""
    return seconds * 1.02 + 1.0


def _default(name: str) -> float:
    default = GatewaySettings.model_fields[name].default
    assert isinstance(default, float)
    return default


async def test_caller_cancel_reaches_the_router(stub, router: FakeRouter) -> None:
    router.mode = "hang"
    call = stub.Generate(request(), metadata=auth_metadata(KEYS["acme"]))
    first = await call.read()
    assert first.text == "w0 "
    call.cancel()
    await asyncio.wait_for(router.cancelled.wait(), 5.0)


async def test_router_deadline_exceeded_maps_to_deadline_exceeded(stub, router: FakeRouter) -> None:
    router.mode = "hang"
    call = stub.Generate(request(), metadata=auth_metadata(KEYS["acme"]), timeout=0.5)
    await expect_status(call, grpc.StatusCode.DEADLINE_EXCEEDED)
    await asyncio.wait_for(router.cancelled.wait(), 5.0)


async def test_resource_exhausted_keeps_its_retry_after_trailer(stub, router: FakeRouter) -> None:
    router.mode = "exhausted"
    err = await expect_status(
        stub.Generate(request(), metadata=auth_metadata(KEYS["acme"])), grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    trailers = dict(err.trailing_metadata() or ())
    assert trailers[md.RETRY_AFTER_MS] == "1234"
    assert len(trailers[md.REQUEST_ID]) == 32, "errors after authentication carry the request id too"
    err = await expect_status(
        stub.Complete(request(), metadata=auth_metadata(KEYS["acme"])), grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert dict(err.trailing_metadata() or ())[md.RETRY_AFTER_MS] == "1234"


async def test_router_internal_error_text_never_reaches_the_caller(stub, router: FakeRouter) -> None:
    router.mode = "crash"
    err = await expect_status(stub.Generate(request(), metadata=auth_metadata(KEYS["acme"])), grpc.StatusCode.INTERNAL)
    assert "secret" not in (err.details() or "") and "10.0.0.7" not in (err.details() or "")


async def test_router_down_is_unavailable() -> None:
    running = await serve(gateway_settings(f"127.0.0.1:{free_port()}"))
    try:
        async with MeshClient(f"127.0.0.1:{running.port}", api_key=KEYS["acme"]) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate("hello", timeout_s=5.0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "\n" not in (err.value.details() or "")
    finally:
        await running.stop()


async def test_chat_turns_are_relayed_on_one_stream(client: MeshClient, router: FakeRouter) -> None:
    async with client.chat(timeout_s=10.0) as session:
        first = await session.turn("hi", max_tokens=4)
        second = await session.turn([("system", "be brief"), ("user", "again")], max_tokens=4)
    assert first.text == second.text == "c0 c1 c2 "
    assert first.final is not None and first.final.finish_reason == pb.FINISH_REASON_LENGTH
    assert first.request_id and first.request_id == second.request_id
    assert [r.WhichOneof("action") for r in router.chat_requests] == ["turn", "turn"]
    (seen,) = router.seen
    assert seen.metadata[md.TENANT] == "acme" and seen.metadata[md.REQUEST_ID] == first.request_id


async def test_chat_with_a_wrong_key_is_unauthenticated_every_time(stack: Stack, router: FakeRouter) -> None:
    """The client writes its first turn only after the gateway accepted the stream, so a rejection
    is always reported as UNAUTHENTICATED (never grpc.aio's "Internal error from Core" write race)."""
    async with MeshClient(stack.address, api_key="wrong") as client:
        for _ in range(20):
            async with client.chat(timeout_s=10.0) as session:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await session.turn("hello")
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    assert router.chat_requests == []


async def test_chat_in_band_cancel_is_relayed_in_order(client: MeshClient, router: FakeRouter) -> None:
    async with client.chat(timeout_s=10.0) as session:
        await session.turn("hi")
        session.cancel()
        await session.turn("again")
    assert [r.WhichOneof("action") for r in router.chat_requests] == ["turn", "cancel", "turn"]


async def test_chat_caller_cancel_reaches_the_router(client: MeshClient, router: FakeRouter) -> None:
    router.mode = "hang"
    session = client.chat(timeout_s=10.0)
    session.send_turn("tell me a long story")
    assert (await session.next_frame()).text == "x"
    session.call.cancel()
    await asyncio.wait_for(router.cancelled.wait(), 5.0)


@pytest.mark.parametrize(
    "bad",
    [
        pb.ChatRequest(),
        pb.ChatRequest(turn=pb.ChatTurn()),
        pb.ChatRequest(turn=pb.ChatTurn(messages=[pb.ChatMessage(role="wizard", content="hi")])),
        pb.ChatRequest(turn=pb.ChatTurn(messages=[pb.ChatMessage(role="user", content="")])),
        pb.ChatRequest(turn=pb.ChatTurn(messages=[pb.ChatMessage(role="user", content="hi")] * 65)),
        pb.ChatRequest(
            turn=pb.ChatTurn(
                messages=[pb.ChatMessage(role="user", content="hi")], sampling=pb.SamplingParams(temperature=3)
            )
        ),
    ],
    ids=["no-action", "no-messages", "bad-role", "empty-content", "too-many", "temperature"],
)
async def test_invalid_chat_frame_ends_the_stream_with_invalid_argument(stub, router: FakeRouter, bad) -> None:
    async def requests():
        yield bad

    call = stub.Chat(requests(), metadata=auth_metadata(KEYS["acme"]))
    await expect_status(call, grpc.StatusCode.INVALID_ARGUMENT)
    assert router.chat_requests == []


async def test_chat_without_key_is_unauthenticated(stub, router: FakeRouter) -> None:
    async def requests():
        yield pb.ChatRequest(turn=pb.ChatTurn(messages=[pb.ChatMessage(role="user", content="hi")]))

    await expect_status(stub.Chat(requests()), grpc.StatusCode.UNAUTHENTICATED)
    assert router.seen == []


async def test_print_stream_writes_answer_and_route(stack: Stack, router: FakeRouter) -> None:
    import io

    from services.cli.client import print_stream

    out, err = io.StringIO(), io.StringIO()
    result = await print_stream(stack.address, KEYS["acme"], "hello", out=out, err=err)
    assert out.getvalue() == "c0 c1 c2 \n"
    assert "edge via edge-fake" in err.getvalue() and result.request_id in err.getvalue()


async def test_cli_chat_streams_through_the_gateway(stack: Stack, router: FakeRouter) -> None:
    """`meshserve chat` as users run it: a separate process (grpc.aio is bound to one event loop)."""

    async def cli(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", *args, stdout=PIPE, stderr=PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        return proc.returncode or 0, out.decode(), err.decode()

    code, out, err = await cli(
        "chat", "hello there", "--address", stack.address, "--api-key", KEYS["acme"], "--tier", "edge"
    )
    assert code == 0, err
    assert out == "c0 c1 c2 \n" and "edge via edge-fake" in err
    (turn,) = router.chat_requests
    assert turn.turn.routing.tier == pb.TIER_EDGE and turn.turn.messages[0].content == "hello there"
    code, _out, err = await cli("chat", "hello", "--address", stack.address, "--api-key", "wrong")
    assert code == 1 and "UNAUTHENTICATED" in err
