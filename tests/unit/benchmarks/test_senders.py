"""The HTTP sender against the fake OpenAI backend (a real aiohttp server on port 0)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from benchmarks.gateway import fake_openai
from benchmarks.load.generator import Workload, make_items
from benchmarks.load.senders import http_sender, route_label
from services.common.pb.meshserve.v1 import inference_pb2 as pb


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    runner = web.AppRunner(fake_openai.build_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_streams_prompts_and_chats_token_by_token(backend: str) -> None:
    items = make_items(Workload(short=0.5, chat=0.5, max_tokens=7), 20, random.Random(3))
    assert {i.kind for i in items} == {"short", "chat"}
    async with aiohttp.ClientSession() as session:
        send = http_sender(session, backend, model="fake")
        for item in items:
            result = await send(item)
            assert result.status == "OK" and result.tokens == 7 and len(result.token_times) == 7
            assert result.ttft is not None and result.total >= result.token_times[-1] >= result.ttft
            assert result.route == "unknown"  # the OpenAI API does not say where it ran


async def test_an_http_error_is_recorded_with_its_status(backend: str) -> None:
    item = make_items(Workload(), 1, random.Random(1))[0]
    async with aiohttp.ClientSession() as session:
        result = await http_sender(session, backend + "/missing")(item)
    assert result.status == "HTTP 404" and result.tokens == 0


def test_route_label_names_cache_tier_and_worker() -> None:
    hit = pb.Final(route=pb.RouteInfo(cache_hit=True))
    served = pb.Final(route=pb.RouteInfo(tier=pb.TIER_CLOUD, worker_id="cloud-0"))
    assert (route_label(hit), route_label(served), route_label(None)) == ("cache", "cloud/cloud-0", "unknown")
