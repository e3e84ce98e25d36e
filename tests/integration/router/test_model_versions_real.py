"""Two versions of the default build on real edge workers (the real INT4 model, one worker per version,
each reporting its own build id): a shadow of the same weights agrees with the primary on every
greedy answer (of a Generate and of each chat turn), and the response cache never serves one
version's answer for the other."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from services.common.model_paths import DEFAULT_MODEL_ID
from services.common.sampling import SamplingParams
from services.common.settings import load_settings
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.startup import start_edge_worker
from services.router.api import RouterAPI
from services.router.config import RouterSettings
from services.router.rollout import RolloutPolicy
from services.router.server import start_router_api
from services.router.types import ChatMessage, ChatTurn, Done, Generation, Routing
from services.worker.app import RunningWorker
from tests.integration.router.harness import TOKEN

pytestmark = pytest.mark.integration
MODELS = f"""
models:
  - id: {DEFAULT_MODEL_ID}
    versions: [{{name: v1, build: build-a}}, {{name: v2, build: build-b}}]
    rollout: {{weights: {{v1: 100}}}}
"""


@pytest.fixture(scope="module")
async def versions(tmp_path_factory: pytest.TempPathFactory, redis_srv: object) -> AsyncIterator[RouterAPI]:
    workers: list[RunningWorker] = []
    for name, build in (("v1", "build-a"), ("v2", "build-b")):
        settings = load_settings(
            EdgeWorkerSettings,
            port=0,
            threads=1,
            max_active_sequences=2,
            worker_id=f"edge-{name}",
            model_version=build,
            internal_token=TOKEN,
            warmup=False,
        )
        workers.append(await start_edge_worker(settings))
    path = Path(tmp_path_factory.mktemp("versions")) / "models.yaml"
    path.write_text(MODELS)
    router_settings = load_settings(
        RouterSettings,
        edge_workers=",".join(f"127.0.0.1:{w.port}" for w in workers),
        models_file=str(path),
        redis_url=redis_srv.url,  # type: ignore[attr-defined]
        internal_token=TOKEN,
        shutdown_grace_s=0,
        cache_retry_after_s=0,
    )
    server, api = await start_router_api(router_settings)
    try:
        yield api
    finally:
        await server.stop()
        for w in workers:
            await w.stop()


def greedy(prompt: str, *, use_cache: bool) -> Generation:
    return Generation(
        model="",
        prompt=prompt,
        sampling=SamplingParams(max_tokens=6, temperature=0.0),
        routing=Routing(use_cache=use_cache),
        tenant="acme",
        request_id="r",
    )


async def test_a_shadow_of_the_same_weights_agrees_with_the_primary(versions: RouterAPI) -> None:
    rollout = versions.models.get("").rollout
    rollout.set_policy(RolloutPolicy({"v1": 100, "v2": 0}, shadow="v2"))
    try:
        for prompt in ("The capital of France is", "Name three colours:", "2 + 2 ="):
            chunk, done = await versions.complete(greedy(prompt, use_cache=False))
            assert done.route.worker_id == "edge-v1" and chunk.token_ids
            await asyncio.gather(*versions.shadows)
        v2 = rollout.counters["v2"]
        assert (v2.shadow_requests, v2.shadow_compared, v2.shadow_agreed) == (3, 3, 3)
    finally:
        rollout.set_policy(replace(rollout.policy, shadow=None))


async def test_a_shadowed_chat_agrees_turn_by_turn_and_keeps_its_primary_stream(versions: RouterAPI) -> None:
    rollout = versions.models.get("").rollout
    rollout.set_policy(RolloutPolicy({"v1": 100, "v2": 0}, shadow="v2"))
    v2 = rollout.counters["v2"]
    before = (v2.shadow_requests, v2.shadow_compared, v2.shadow_agreed)
    try:
        chat = versions.chat(tenant="acme")
        for question in ("The capital of France is", "And the capital of Italy is"):
            await chat.send(ChatTurn([ChatMessage("user", question)], SamplingParams(max_tokens=6, temperature=0.0)))
        await chat.end()
        routes = [e.event.route for e in [e async for e in chat.events()] if isinstance(e.event, Done)]
        await asyncio.gather(*versions.shadows)
        assert [r.worker_id for r in routes] == ["edge-v1", "edge-v1"]  # the caller's turns: the primary's
        # Turn 2 on the primary continued its chat stream (KV kept), its copy prefilled the whole
        # conversation on v2: the same greedy text.
        after = (v2.shadow_requests, v2.shadow_compared, v2.shadow_agreed)
        assert tuple(a - b for a, b in zip(after, before, strict=True)) == (2, 2, 2)
    finally:
        rollout.set_policy(replace(rollout.policy, shadow=None))


async def test_the_response_cache_never_mixes_versions(versions: RouterAPI, redis_url: str) -> None:
    rollout = versions.models.get("").rollout
    prompt = "A cached answer belongs to one version:"
    rollout.set_policy(RolloutPolicy({"v1": 100, "v2": 0}))
    _, first = await versions.complete(greedy(prompt, use_cache=True))
    _, again = await versions.complete(greedy(prompt, use_cache=True))
    assert (first.route.worker_id, first.route.cache_hit, again.route.cache_hit) == ("edge-v1", False, True)
    rollout.set_policy(RolloutPolicy({"v1": 0, "v2": 100}))
    _, other = await versions.complete(greedy(prompt, use_cache=True))
    assert (other.route.worker_id, other.route.cache_hit) == ("edge-v2", False)  # v1's entry is not v2's
    _, other_again = await versions.complete(greedy(prompt, use_cache=True))
    assert other_again.route.cache_hit
