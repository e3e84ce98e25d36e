"""The HTTP adapter behind Envoy serves Prometheus /metrics (docs/metrics.md: every service serves one): requests
through the front door are counted there by endpoint and status."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.frontdoor.conftest import API_KEY, MODEL, Stack

pytestmark = pytest.mark.integration


async def _counts(url: str) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        text = await response.text()
    return {
        (s.labels["endpoint"], s.labels["code"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "meshserve_http_requests_total"
    }


async def test_front_door_requests_are_counted_on_the_adapters_metrics(stack: Stack, router: object) -> None:
    urls = [f"http://127.0.0.1:{a.metrics_port}/metrics" for a in stack.door.adapters]
    assert urls and all(a.metrics_port for a in stack.door.adapters)
    before = [await _counts(url) for url in urls]
    async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key=API_KEY, max_retries=0) as client:
        await client.models.list()
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key="wrong", max_retries=0) as bad:
                await bad.models.list()
    after = [await _counts(url) for url in urls]

    def added(key: tuple[str, str]) -> float:
        return sum(a.get(key, 0.0) - b.get(key, 0.0) for a, b in zip(after, before, strict=True))

    assert added(("/v1/models", "200")) == 1
    assert added(("/v1/chat/completions", "200")) == 1
    assert added(("/v1/models", "401")) == 1
