"""The gateway's access log: one `request_done` line per call, with the bound request id and tenant,
the route and token counts, and never the prompt or the answer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import structlog
from structlog.testing import capture_logs

from services.cli.client import MeshClient, auth_metadata
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.gateway.observe import PROMPT_CHARS
from services.gateway.server import serve
from tests.integration.gateway.conftest import KEYS, FakeRouter, Stack, gateway_settings

pytestmark = pytest.mark.integration
PROMPT = "a secret prompt about the lighthouse keeper"


@contextmanager
def access_log(prompts_logged: bool = False) -> Iterator[list[dict[str, object]]]:
    """The `request_done` entries logged meanwhile, with the context the service binds merged in."""
    lines: list[dict[str, object]] = []
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        yield lines
    lines.extend(entry for entry in logs if entry["event"] == "request_done")
    for entry in logs:  # no line of the gateway's carries the answer, nor the prompt unless asked to
        assert "w1 " not in str(entry) and "c1 " not in str(entry)
        assert prompts_logged or PROMPT not in str(entry)


async def _done_lines(lines: list[dict[str, object]], count: int) -> list[dict[str, object]]:
    for _ in range(100):  # the line is written as the handler ends, just after the caller's last frame
        if len(lines) >= count:
            break
        await asyncio.sleep(0.02)
    return lines


async def test_a_generate_call_is_one_line_with_its_route_and_tokens(
    stub: inference_pb2_grpc.InferenceStub, router: FakeRouter
) -> None:
    with access_log() as lines:
        request = pb.GenerateRequest(prompt=PROMPT)
        frames = [f async for f in stub.Generate(request, metadata=auth_metadata(KEYS["acme"]))]
        await asyncio.sleep(0.1)
    (line,) = lines
    assert line["request_id"] == frames[-1].request_id and line["tenant"] == "acme"
    assert (line["method"], line["status"], line["tier"], line["worker"]) == ("Generate", "OK", "edge", "edge-fake")
    assert (line["prompt_tokens"], line["completion_tokens"], line["turns"]) == (5, 3, 1)
    assert isinstance(line["ttft_ms"], float) and isinstance(line["duration_ms"], float)
    assert line["duration_ms"] >= line["ttft_ms"] > 0
    assert line["log_level"] == "info"


async def test_a_refused_call_is_logged_with_its_status(
    stub: inference_pb2_grpc.InferenceStub, router: FakeRouter
) -> None:
    with access_log() as lines:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(pb.GenerateRequest(prompt=PROMPT), metadata=auth_metadata("wrong-key"))
        await asyncio.sleep(0.1)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    (line,) = lines
    assert (line["method"], line["status"], line["tenant"]) == ("Complete", "UNAUTHENTICATED", "")
    assert line["ttft_ms"] is None and line["request_id"]


async def test_a_chat_session_is_one_line_over_its_turns(client: MeshClient, router: FakeRouter) -> None:
    with access_log() as lines:
        async with client.chat(timeout_s=10.0) as session:
            await session.turn(PROMPT, max_tokens=4)
            await session.turn("again", max_tokens=4)
        await _done_lines(lines, 1)
    (line,) = lines
    assert (line["method"], line["status"], line["turns"]) == ("Chat", "OK", 2)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (10, 6)


async def test_prompts_are_logged_only_when_switched_on(stack: Stack, router: FakeRouter) -> None:
    running = await serve(gateway_settings(f"127.0.0.1:{stack.router_server.port}", log_prompts=True))
    try:
        async with MeshClient(f"127.0.0.1:{running.port}", api_key=KEYS["acme"]) as client:
            with access_log(prompts_logged=True) as lines:
                await client.generate(PROMPT + "x" * 3000, max_tokens=3)
                async with client.chat(timeout_s=10.0) as session:
                    await session.turn([("system", "be brief"), ("user", PROMPT)], max_tokens=4)
                await _done_lines(lines, 2)
    finally:
        await running.stop()
    generate, chat = sorted(lines, key=lambda line: str(line["method"]), reverse=True)
    assert generate["method"] == "Generate" and generate["prompts"] == [(PROMPT + "x" * 3000)[:PROMPT_CHARS]]
    assert chat["method"] == "Chat" and chat["prompts"] == ["be brief", PROMPT]
