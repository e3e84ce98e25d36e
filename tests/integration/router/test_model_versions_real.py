"""Several models and versions on real edge workers (the real model, one worker per version, each
reporting its own model id and build), the rollout changed through the real RouterAdmin gRPC service:

* ``v1`` and ``v2``: the prepared INT4 build under two build ids (same weights, same greedy tokens);
* ``int8``: the INT8 draft build of the same checkpoint (other numerics: some greedy answers differ);
* ``slow``: the INT4 build with the worker's fault injection on (``fault_first_token_delay_s``): an
  injected slow version;
* ``other-model``: a second model id, served from the INT4 build's directory.

What the issue's "Show" asks, on these workers: routing by model; a 95/5 canary within ±3 % over
2,000 requests; a chat never changes version; shadow output never reaches the caller; rollback under
load fails no request; the slow version is rolled back automatically. Plus: a shadow of the same
weights agrees with the primary, the response cache never mixes versions, and ``cache where`` answers
for any model and version. The same over fake workers (and the CLI): test_models.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from services.common.config import load_settings
from services.common.errors import NotFound
from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as admin_pb
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import SamplingParams
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.server import start_edge_worker
from services.router.frontend.api import RouterAPI
from services.router.frontend.rollout import RolloutPolicy
from services.router.metrics import ROLLBACKS
from services.router.types import ChatMessage, ChatTurn, Done, Generation, Routing
from services.worker.server import RunningWorker
from tests.integration.router.harness import ADMIN_META as ADMIN
from tests.integration.router.harness import HF_DIR, META, TOKEN, ModelsRouter, open_models_router

pytestmark = pytest.mark.integration
OTHER = "other-model"
SLOW_DELAY_S = 1.5
"""The slow version's injected delay before its first token: far above the rollback rule's 0.25 s
margin, so a TTFT spike of the primary's on a loaded machine does not hide it."""
PATHS = model_paths()
MODELS = f"""
models:
  - id: {DEFAULT_MODEL_ID}
    versions: [{{name: v1, build: build-a}}, {{name: v2, build: build-b}}, {{name: int8, build: build-int8}},
               {{name: slow, build: build-slow}}]
    rollout: {{weights: {{v1: 100}}}}
  - id: {OTHER}
    tokenizer_dir: {HF_DIR}
    versions: [{{name: o1, build: build-o}}]
"""
WORKERS = {  # worker id -> (model id, build, model directory, injected first-token delay)
    "edge-v1": (DEFAULT_MODEL_ID, "build-a", PATHS.edge_dir, 0.0),
    "edge-v2": (DEFAULT_MODEL_ID, "build-b", PATHS.edge_dir, 0.0),
    "edge-int8": (DEFAULT_MODEL_ID, "build-int8", PATHS.root / "draft-int8", 0.0),
    "edge-slow": (DEFAULT_MODEL_ID, "build-slow", PATHS.edge_dir, SLOW_DELAY_S),
    "edge-other": (OTHER, "build-o", PATHS.edge_dir, 0.0),
}
V1 = {"v1": 100, "v2": 0, "int8": 0, "slow": 0}
Versions = ModelsRouter[RunningWorker]


@pytest.fixture(scope="module")
async def versions(tmp_path_factory: pytest.TempPathFactory, redis_srv: object) -> AsyncIterator[Versions]:
    async def start(worker_id: str) -> RunningWorker:
        model_id, build, directory, delay = WORKERS[worker_id]
        settings = load_settings(
            EdgeWorkerSettings,
            port=0,
            threads=1,
            max_active_sequences=16,  # the canary's 32 concurrent requests share decode calls
            worker_id=worker_id,
            model_id=model_id,
            model_dir=str(directory),
            model_version=build,
            internal_token=TOKEN,
            warmup=False,
            fault_first_token_delay_s=delay,
        )
        return await start_edge_worker(settings)

    workers: dict[str, RunningWorker] = {}
    try:
        for worker_id in WORKERS:  # one at a time: loading is CPU-bound
            workers[worker_id] = await start(worker_id)
        addresses = [f"127.0.0.1:{w.port}" for w in workers.values()]
        async with open_models_router(
            workers,
            addresses,
            MODELS,
            tmp_path_factory.mktemp("versions"),
            DEFAULT_MODEL_ID,
            redis_url=redis_srv.url,  # type: ignore[attr-defined]
            cache_retry_after_s=0,
        ) as opened:
            yield opened
    finally:
        for w in workers.values():
            await w.stop()


@pytest.fixture(autouse=True)
async def reset(versions: Versions) -> None:
    await versions.rollout(weights=V1, shadow="", clear_rollback=True, sticky="chat")


def greedy(prompt: str, *, use_cache: bool, max_tokens: int = 6, model: str = "") -> Generation:
    return Generation(
        model=model,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        routing=Routing(use_cache=use_cache),
        tenant="acme",
        request_id="r",
    )


def sampled(prompt: str, *, max_tokens: int = 1, model: str = "") -> Generation:
    """A tiny request with unseeded sampling: never answered from the response cache nor collapsed with
    another (services/router/balancer/core.py serves only deterministic requests from those), so each one is
    routed by the rollout's draw."""
    return Generation(
        model=model,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
        routing=Routing(),
        tenant="acme",
        request_id="r",
    )


async def served_by(api: RouterAPI, gen: Generation) -> str:
    _, done = await api.complete(gen)
    assert done.completion_tokens >= 1 and not done.route.cache_hit  # generated (a sampled EOS counts, unsent)
    return done.route.worker_id


async def test_requests_are_routed_by_model(versions: Versions) -> None:
    api = versions.api
    assert await served_by(api, sampled("Hi", model=OTHER)) == "edge-other"
    assert await served_by(api, sampled("Hi", model=DEFAULT_MODEL_ID)) == "edge-v1"
    assert await served_by(api, sampled("Hi")) == "edge-v1"  # no model: the default one
    with pytest.raises(NotFound, match=f"'nope'.*{DEFAULT_MODEL_ID}, {OTHER}"):
        await api.complete(sampled("Hi", model="nope"))
    # Over gRPC: GenerateRequest.model picks the model; ListModels lists both with their tier.
    request = pb.GenerateRequest(prompt="Hi", model=OTHER, sampling=pb.SamplingParams(max_tokens=2, temperature=1.0))
    finals = [r.final async for r in versions.stub.Generate(request, metadata=META) if r.HasField("final")]
    assert [f.route.worker_id for f in finals] == ["edge-other"]
    reply = await versions.stub.ListModels(pb.ListModelsRequest(), metadata=META)
    assert [(m.id, list(m.tiers)) for m in reply.models] == [
        (DEFAULT_MODEL_ID, [pb.TIER_EDGE]),
        (OTHER, [pb.TIER_EDGE]),
    ]


async def test_a_canary_split_is_within_3_percent_of_its_weight_over_2000_requests(versions: Versions) -> None:
    status = await versions.rollout(weights={"v1": 95, "v2": 5})
    assert status.primary == "v1"
    before = {v.version: v.requests for v in (await versions.listed()).versions}
    sem = asyncio.Semaphore(32)

    async def one() -> str:
        # A one-token prompt runs no prefill call: each request is one row of a batched decode call
        # (unseeded sampling is never cached nor collapsed, so every request is routed by its own draw).
        async with sem:
            return await served_by(versions.api, sampled("Hi"))

    counts = Counter(await asyncio.gather(*(one() for _ in range(2000))))
    assert set(counts) == {"edge-v1", "edge-v2"}, counts
    assert abs(counts["edge-v2"] / 2000 - 0.05) <= 0.03, counts
    after = {v.version: v.requests for v in (await versions.listed()).versions}
    assert after["v2"] - before["v2"] == counts["edge-v2"] and after["v1"] - before["v1"] == counts["edge-v1"]


async def test_a_chat_never_changes_version(versions: Versions) -> None:
    await versions.rollout(weights={"v1": 50, "v2": 50})
    seen: set[str] = set()
    for c in range(12):
        chat = versions.api.chat(tenant=f"t{c}")
        for turn in range(3):
            await chat.send(
                ChatTurn([ChatMessage("user", f"Say {turn}")], SamplingParams(max_tokens=2, temperature=1.0))
            )
        await chat.end()
        workers = [e.event.route.worker_id async for e in chat.events() if isinstance(e.event, Done)]
        assert len(workers) == 3 and len(set(workers)) == 1, workers
        seen.add(workers[0])
    assert seen == {"edge-v1", "edge-v2"}  # the chats did spread over both versions


async def test_shadow_output_never_reaches_the_caller(versions: Versions) -> None:
    """The INT8 build shadows the INT4 primary: on prompts where their greedy answers differ, the
    caller still gets the primary's answer, and the shadow's differing answer is only counted."""
    prompts = ["The capital of France is", "Write a haiku about rain:", "List three prime numbers:", "Once upon a"]
    answers: dict[str, list[str]] = {}
    for version in ("v1", "int8"):  # each build's own greedy answers, no shadow, no cache
        await versions.rollout(weights={**{k: 0 for k in V1}, version: 100})
        answers[version] = [(await versions.api.complete(greedy(p, use_cache=False)))[0].text for p in prompts]
    differing = sum(a != b for a, b in zip(answers["v1"], answers["int8"], strict=True))
    assert differing >= 1, answers  # else this test could not tell the two outputs apart
    await versions.rollout(weights=V1, shadow="int8")
    before = (await versions.listed()).versions
    for prompt, primary in zip(prompts, answers["v1"], strict=True):
        chunk, done = await versions.api.complete(greedy(prompt, use_cache=False))
        assert (done.route.worker_id, chunk.text) == ("edge-v1", primary)
    await asyncio.gather(*versions.api.shadows)
    after = {v.version: v for v in (await versions.listed()).versions}
    int8 = {v.version: v for v in before}["int8"]
    assert after["int8"].shadow_requests - int8.shadow_requests == len(prompts)
    assert after["int8"].shadow_compared - int8.shadow_compared == len(prompts)
    assert after["int8"].shadow_agreed - int8.shadow_agreed == len(prompts) - differing


async def test_a_shadow_of_the_same_weights_agrees_with_the_primary(versions: Versions) -> None:
    rollout = versions.api.models.get("").rollout
    rollout.set_policy(RolloutPolicy(V1, shadow="v2"))
    before = replace(rollout.counters["v2"])
    for prompt in ("The capital of France is", "Name three colours:", "2 + 2 ="):
        chunk, done = await versions.api.complete(greedy(prompt, use_cache=False))
        assert done.route.worker_id == "edge-v1" and chunk.token_ids
        await asyncio.gather(*versions.api.shadows)
    v2 = rollout.counters["v2"]
    assert v2.shadow_requests - before.shadow_requests == 3
    assert (v2.shadow_compared - before.shadow_compared, v2.shadow_agreed - before.shadow_agreed) == (3, 3)


async def test_a_shadowed_chat_agrees_turn_by_turn_and_keeps_its_primary_stream(versions: Versions) -> None:
    rollout = versions.api.models.get("").rollout
    rollout.set_policy(RolloutPolicy(V1, shadow="v2"))
    v2 = rollout.counters["v2"]
    before = (v2.shadow_requests, v2.shadow_compared, v2.shadow_agreed)
    chat = versions.api.chat(tenant="acme")
    for question in ("The capital of France is", "And the capital of Italy is"):
        await chat.send(ChatTurn([ChatMessage("user", question)], SamplingParams(max_tokens=6, temperature=0.0)))
    await chat.end()
    routes = [e.event.route for e in [e async for e in chat.events()] if isinstance(e.event, Done)]
    await asyncio.gather(*versions.api.shadows)
    assert [r.worker_id for r in routes] == ["edge-v1", "edge-v1"]  # the caller's turns: the primary's
    # Turn 2 on the primary continued its chat stream (KV kept), its copy prefilled the whole
    # conversation on v2: the same greedy text.
    after = (v2.shadow_requests, v2.shadow_compared, v2.shadow_agreed)
    assert tuple(a - b for a, b in zip(after, before, strict=True)) == (2, 2, 2)


async def test_the_response_cache_never_mixes_versions(versions: Versions, redis_url: str) -> None:
    rollout = versions.api.models.get("").rollout
    prompt = "A cached answer belongs to one version:"
    rollout.set_policy(RolloutPolicy(V1))
    _, first = await versions.api.complete(greedy(prompt, use_cache=True))
    _, again = await versions.api.complete(greedy(prompt, use_cache=True))
    assert (first.route.worker_id, first.route.cache_hit, again.route.cache_hit) == ("edge-v1", False, True)
    rollout.set_policy(RolloutPolicy({"v1": 0, "v2": 100}))
    _, other = await versions.api.complete(greedy(prompt, use_cache=True))
    assert (other.route.worker_id, other.route.cache_hit) == ("edge-v2", False)  # v1's entry is not v2's
    _, other_again = await versions.api.complete(greedy(prompt, use_cache=True))
    assert other_again.route.cache_hit


async def test_rollback_under_load_fails_no_request(versions: Versions) -> None:
    """Eight clients send requests back to back while the rollout is changed and rolled back twice
    through the admin service: none fails, and requests drawn after the last rollback all land on the
    primary."""
    await versions.rollout(weights={"v1": 50, "v2": 50})
    rolled = asyncio.Event()
    served: list[str] = []
    after: list[str] = []
    failed: list[BaseException] = []

    async def client(c: int) -> None:
        i = 0
        while len(after) < 40 and len(failed) < 10:  # a failing mesh ends the load too
            drawn_after = rolled.is_set()
            try:
                worker = await served_by(versions.api, sampled(f"load {c} {i}", max_tokens=2))
            except Exception as exc:  # a failed request: collected, the load goes on
                failed.append(exc)
                continue
            finally:
                i += 1
            (after if drawn_after else served).append(worker)

    async def change() -> None:
        # The primary is the heaviest version (the first on a tie): v1 throughout.
        for weights in ({"v1": 80, "v2": 20}, None, {"v1": 50, "v2": 50}, None):
            await asyncio.sleep(0.5)
            if weights is None:
                status = await versions.admin.Rollback(admin_pb.RollbackRequest(model=DEFAULT_MODEL_ID), metadata=ADMIN)
                assert {w.version: w.weight for w in status.weights}["v1"] == 100
            else:
                await versions.rollout(weights=weights)
        rolled.set()

    await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(8)), change()), 120)
    assert failed == []  # zero failed requests
    assert set(served) == {"edge-v1", "edge-v2"}  # both versions served while the rollout changed
    assert len(after) >= 40 and set(after) == {"edge-v1"}  # drawn after the last rollback: the primary only
    assert (await versions.listed()).rollbacks[-1].reason == "manual"


async def test_an_injected_slow_version_is_rolled_back_automatically(versions: Versions) -> None:
    rule = admin_pb.RollbackRule(error_rate_margin=0.5, ttft_p99_margin_ms=250, window_s=120, min_samples=8)
    await versions.rollout(weights={"v1": 50, "slow": 50}, rollback=rule)
    before = ROLLBACKS.labels(DEFAULT_MODEL_ID, "slow", "auto")._value.get()
    sem = asyncio.Semaphore(4)
    served: list[str] = []

    async def one(i: int) -> None:
        async with sem:
            served.append(await served_by(versions.api, sampled(f"slow {i}")))

    await asyncio.gather(*(one(i) for i in range(64)))
    assert "edge-slow" in served  # the canary did serve before it went back
    rollout = await versions.listed()
    assert {w.version: w.weight for w in rollout.weights}["slow"] == 0
    assert rollout.rollbacks[-1].version == "slow" and "ttft p99" in rollout.rollbacks[-1].reason
    assert ROLLBACKS.labels(DEFAULT_MODEL_ID, "slow", "auto")._value.get() == before + 1
    assert {await served_by(versions.api, sampled(f"after {i}")) for i in range(10)} == {"edge-v1"}


async def test_cache_where_answers_for_any_model_and_version(versions: Versions) -> None:
    async def where(**fields: str) -> tuple[str, str, str, list[str]]:
        req = admin_pb.PrefixLocationRequest(text="Hello there", tier=pb.TIER_EDGE, **fields)  # type: ignore[arg-type]
        r = await versions.admin.PrefixLocation(req, metadata=ADMIN)
        return r.model_id, r.version, r.model_version, [h.worker_id for h in r.replicas]

    assert await where() == (DEFAULT_MODEL_ID, "v1", "build-a", ["edge-v1"])
    assert await where(version="int8") == (DEFAULT_MODEL_ID, "int8", "build-int8", ["edge-int8"])
    assert await where(model=OTHER) == (OTHER, "o1", "build-o", ["edge-other"])
