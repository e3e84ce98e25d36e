"""Several models and versions on one router (a models file): routing by model, canary split, sticky
chats, shadow copies, rollback under load and automatic rollback, on a real router over fake workers
(each reporting its model id and build) reached over the stream transport, with the rollout changed
through the real RouterAdmin gRPC service. Two versions of the real model:
test_model_versions_real.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.errors import NotFound
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as admin_pb
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer
from services.router.balancer.tiers import TierName
from services.router.frontend.api import RouterAPI
from services.router.metrics import ROLLBACKS
from services.router.types import ChatMessage, ChatTurn, Done, Generation, Routing
from tests.integration.router.fake_worker import FakeWorker, start_fake
from tests.integration.router.harness import ADMIN_META, HF_DIR, META, TOKEN, ModelsRouter, open_models_router

DEFAULT = "smollm2-135m-instruct"
MODELS = f"""
models:
  - id: {DEFAULT}
    versions: [{{name: v1}}, {{name: v2}}, {{name: v3, build: build-3}}]
    rollout: {{weights: {{v1: 100}}}}
  - id: other-model
    tokenizer_dir: {HF_DIR}
    context_length: 2048
    versions: [{{name: b1}}]
"""
Models = ModelsRouter[FakeWorker]


@pytest.fixture(scope="module")
async def models(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> AsyncIterator[Models]:
    workers = {
        "v1": await start_fake("w-v1", pb.TIER_EDGE, TOKEN, model=DEFAULT, model_version="v1"),
        "v2": await start_fake("w-v2", pb.TIER_EDGE, TOKEN, model=DEFAULT, model_version="v2", weights=1),
        "v3": await start_fake("w-v3", pb.TIER_EDGE, TOKEN, model=DEFAULT, model_version="build-3", weights=1),
        "b1": await start_fake("w-b1", pb.TIER_EDGE, TOKEN, model="other-model", model_version="b1", weights=3),
    }
    addresses = [w.address for w in workers.values()]
    tmp = tmp_path_factory.mktemp("models")
    try:
        async with open_models_router(
            workers, addresses, MODELS, tmp, DEFAULT, tokenizer, collapse_requests=False
        ) as opened:
            yield opened
    finally:
        for w in workers.values():
            assert w.server is not None
            await w.server.stop()


@pytest.fixture(autouse=True)
async def reset(models: Models) -> None:
    for w in models.workers.values():
        w.token_delay_s = 0.0
    await models.rollout(weights={"v1": 100, "v2": 0, "v3": 0}, shadow="", clear_rollback=True, sticky="chat")


def generation(prompt: str = "Hello there", model: str = "", *, greedy: bool = False, tenant: str = "t") -> Generation:
    sampling = SamplingParams(max_tokens=2, temperature=0.0 if greedy else 0.8)
    return Generation(model=model, prompt=prompt, sampling=sampling, routing=Routing(), tenant=tenant, request_id="r")


async def served_by(api: RouterAPI, gen: Generation) -> str:
    _, done = await api.complete(gen)
    return done.route.worker_id


async def test_requests_are_routed_by_model_and_an_unknown_model_is_refused(models: Models) -> None:
    api = models.api
    assert await served_by(api, generation(model="other-model")) == "w-b1"
    assert await served_by(api, generation(model=DEFAULT)) == "w-v1"
    assert await served_by(api, generation()) == "w-v1"  # no model: the default one
    with pytest.raises(NotFound, match=f"'nope'.*{DEFAULT}, other-model"):
        await api.complete(generation(model="nope"))
    listed = {m.id: m for m in await api.list_models()}
    assert listed.keys() == {DEFAULT, "other-model"}
    assert listed["other-model"].context_length == 2048 and listed["other-model"].tiers == (TierName.EDGE,)
    # Over gRPC: ListModels lists both, an unknown model is NOT_FOUND naming the served ones.
    reply = await models.stub.ListModels(pb.ListModelsRequest(), metadata=META)
    assert [m.id for m in reply.models] == [DEFAULT, "other-model"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in models.stub.Generate(pb.GenerateRequest(prompt="hi", model="nope"), metadata=META):
            pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "other-model" in (err.value.details() or "")


async def test_a_canary_split_is_within_3_percent_of_its_weight_over_2000_requests(models: Models) -> None:
    status = await models.rollout(weights={"v1": 95, "v2": 5, "v3": 0})
    assert status.primary == "v1"
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> str:
        async with sem:
            return await served_by(models.api, generation(f"prompt {i}"))

    counts = Counter(await asyncio.gather(*(one(i) for i in range(2000))))
    assert set(counts) == {"w-v1", "w-v2"}
    assert abs(counts["w-v2"] / 2000 - 0.05) <= 0.03, counts
    listed = await models.admin.ListRollouts(admin_pb.ListRolloutsRequest(model=DEFAULT), metadata=ADMIN_META)
    versions = {v.version: v for v in listed.models[0].versions}
    assert versions["v2"].requests >= counts["w-v2"] and versions["v2"].healthy_replicas == 1


async def test_a_chat_never_changes_version(models: Models) -> None:
    await models.rollout(weights={"v1": 50, "v2": 50})
    seen: set[str] = set()
    for c in range(16):
        chat = models.api.chat(tenant=f"t{c}")
        workers = []
        for turn in range(3):
            msg = ChatTurn([ChatMessage("user", f"turn {turn}")], SamplingParams(max_tokens=2, temperature=0.8))
            await chat.send(msg)
        await chat.end()
        async for event in chat.events():
            if isinstance(event.event, Done):
                workers.append(event.event.route.worker_id)
        assert len(workers) == 3 and len(set(workers)) == 1, workers
        seen.add(workers[0])
    assert seen == {"w-v1", "w-v2"}  # chats did spread over both versions


async def test_tenant_stickiness_keeps_a_tenant_on_one_version(models: Models) -> None:
    await models.rollout(weights={"v1": 50, "v2": 50}, sticky="tenant")
    for t in range(6):
        served = {await served_by(models.api, generation(f"p{i}", tenant=f"tenant-{t}")) for i in range(5)}
        assert len(served) == 1


async def test_shadow_output_never_reaches_the_caller(models: Models) -> None:
    await models.rollout(shadow="v3")
    v3 = models.workers["v3"]
    before = len(v3.starts)
    chunk, done = await models.api.complete(generation("shadow me", greedy=True))
    await asyncio.gather(*models.api.shadows)
    assert done.route.worker_id == "w-v1"
    assert len(v3.starts) == before + 1  # the copy ran on the shadow version...
    shadow_tokens = v3.tokens(v3.starts[-1])
    assert chunk.token_ids == models.workers["v1"].tokens(models.workers["v1"].starts[-1])
    assert chunk.token_ids != shadow_tokens  # ...and the caller got the primary's output only
    listed = await models.admin.ListRollouts(admin_pb.ListRolloutsRequest(model=DEFAULT), metadata=ADMIN_META)
    v3_status = next(v for v in listed.models[0].versions if v.version == "v3")
    assert v3_status.shadow_requests >= 1 and v3_status.shadow_compared >= 1
    assert v3_status.shadow_agreed == 0  # other weights answer other tokens: recorded as a disagreement


async def test_chat_turns_are_shadowed_without_touching_the_primarys_chat(models: Models) -> None:
    await models.rollout(shadow="v3")
    v1, v3 = models.workers["v1"], models.workers["v3"]
    before1, before3 = len(v1.starts), len(v3.starts)
    listed = await models.admin.ListRollouts(admin_pb.ListRolloutsRequest(model=DEFAULT), metadata=ADMIN_META)
    was = next(v for v in listed.models[0].versions if v.version == "v3")
    chat = models.api.chat(tenant="shadowed")
    for turn in range(2):
        await chat.send(ChatTurn([ChatMessage("user", f"turn {turn}")], SamplingParams(max_tokens=3, temperature=0)))
    await chat.end()
    got: dict[int, list[int]] = {0: [], 1: []}
    workers = []
    async for event in chat.events():
        if isinstance(event.event, Done):
            workers.append(event.event.route.worker_id)
        else:
            got[event.turn].extend(event.event.token_ids)
    await asyncio.gather(*models.api.shadows)
    assert workers == ["w-v1", "w-v1"]
    primary, copies = v1.starts[before1:], v3.starts[before3:]
    assert len(primary) == 2 and len(copies) == 2  # each turn was copied to the shadow version...
    # ...as a stand-alone generation over the same conversation: the primary's chat kept its one
    # worker stream (its KV between turns), the copies each had their own.
    assert len(set(v1.start_calls[before1:])) == 1
    assert len(set(v3.start_calls[before3:])) == 2
    copy_of = {tuple(c.prompt_token_ids): c for c in copies}  # the two copies may start in either order
    assert copy_of.keys() == {tuple(p.prompt_token_ids) for p in primary}
    for turn in (0, 1):  # the caller got the primary's tokens, never the shadow's
        copy = copy_of[tuple(primary[turn].prompt_token_ids)]
        assert got[turn] == v1.tokens(primary[turn]) != v3.tokens(copy)
    listed = await models.admin.ListRollouts(admin_pb.ListRolloutsRequest(model=DEFAULT), metadata=ADMIN_META)
    now = next(v for v in listed.models[0].versions if v.version == "v3")
    assert now.shadow_requests - was.shadow_requests == 2
    assert now.shadow_compared - was.shadow_compared == 2  # greedy: compared, recorded as disagreements
    assert now.shadow_agreed == was.shadow_agreed


async def test_rollback_under_load_fails_no_request(models: Models) -> None:
    await models.rollout(weights={"v1": 50, "v2": 50})
    for w in models.workers.values():
        w.token_delay_s = 0.005
    sem = asyncio.Semaphore(16)
    rolled = asyncio.Event()
    after: list[str] = []

    async def one(i: int) -> None:
        async with sem:
            drawn_after = rolled.is_set()
            worker = await served_by(models.api, generation(f"load {i}"))
            if drawn_after:
                after.append(worker)

    async def roll() -> None:
        await asyncio.sleep(0.2)
        status = await models.admin.Rollback(admin_pb.RollbackRequest(model=DEFAULT), metadata=ADMIN_META)
        assert {w.version: w.weight for w in status.weights} == {"v1": 100, "v2": 0}
        assert status.rollbacks[-1].reason == "manual"
        rolled.set()

    results = await asyncio.gather(*(one(i) for i in range(300)), roll(), return_exceptions=True)
    assert not [r for r in results if isinstance(r, BaseException)]  # zero failed requests
    assert after and set(after) == {"w-v1"}  # drawn after the rollback: the primary only


async def test_a_slow_canary_is_rolled_back_automatically(models: Models) -> None:
    rule = admin_pb.RollbackRule(error_rate_margin=0.5, ttft_p99_margin_ms=100, window_s=60, min_samples=10)
    await models.rollout(weights={"v1": 50, "v2": 50}, rollback=rule)
    models.workers["v2"].token_delay_s = 0.25  # the injected slow version
    before = ROLLBACKS.labels(DEFAULT, "v2", "auto")._value.get()
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> None:
        async with sem:
            await served_by(models.api, generation(f"slow {i}"))

    await asyncio.gather(*(one(i) for i in range(80)))
    listed = await models.admin.ListRollouts(admin_pb.ListRolloutsRequest(model=DEFAULT), metadata=ADMIN_META)
    rollout = listed.models[0]
    assert {w.version: w.weight for w in rollout.weights}["v2"] == 0
    assert "ttft p99" in rollout.rollbacks[-1].reason
    assert ROLLBACKS.labels(DEFAULT, "v2", "auto")._value.get() == before + 1
    assert {await served_by(models.api, generation(f"after {i}")) for i in range(10)} == {"w-v1"}


async def test_a_bad_rollout_is_refused_and_changes_nothing(models: Models) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await models.rollout(weights={"v9": 100})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "v9" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await models.admin.Rollback(admin_pb.RollbackRequest(model="nope"), metadata=ADMIN_META)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await models.admin.ListRollouts(admin_pb.ListRolloutsRequest(), metadata=ADMIN_META)
    assert [m.model for m in listed.models] == [DEFAULT, "other-model"]
    assert {w.version: w.weight for w in listed.models[0].weights}["v1"] == 100


async def test_cache_where_answers_for_any_model_and_version(
    models: Models, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli.cache import main as cache_cli

    async def where(**fields: str) -> admin_pb.PrefixLocationResponse:
        req = admin_pb.PrefixLocationRequest(text="Hello there", tier=pb.TIER_EDGE, **fields)  # type: ignore[arg-type]
        return await models.admin.PrefixLocation(req, metadata=ADMIN_META)

    def seen(reply: admin_pb.PrefixLocationResponse) -> tuple[str, str, str, list[str]]:
        return reply.model_id, reply.version, reply.model_version, [r.worker_id for r in reply.replicas]

    assert seen(await where()) == (DEFAULT, "v1", "v1", ["w-v1"])  # the default model's primary
    assert seen(await where(model=DEFAULT, version="v3")) == (DEFAULT, "v3", "build-3", ["w-v3"])
    assert seen(await where(model="other-model")) == ("other-model", "b1", "b1", ["w-b1"])
    await models.rollout(weights={"v1": 10, "v2": 90})  # v2 is now the primary
    assert seen(await where()) == (DEFAULT, "v2", "v2", ["w-v2"])
    for fields, named in (({"version": "v9"}, "v1, v2, v3"), ({"model": "nope"}, "other-model")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await where(**fields)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and named in (err.value.details() or "")
    argv = ["--internal-token", TOKEN, "where", "Hello there", "--tier", "edge", "--router"]
    argv += [f"127.0.0.1:{models.server.port}", "--model", DEFAULT, "--version", "v3"]
    capsys.readouterr()
    assert await asyncio.to_thread(cache_cli, argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"model:  {DEFAULT} version v3" in lines and any(line.startswith("w-v3 ") for line in lines)
    assert not any(line.startswith(("w-v1 ", "w-v2 ")) for line in lines)


async def test_the_cli_changes_the_rollout_and_status_shows_it(
    models: Models, capsys: pytest.CaptureFixture[str]
) -> None:
    from rich.console import Console

    from services.cli import main
    from services.cli.status import gather, render

    router = f"127.0.0.1:{models.server.port}"
    common = ["--router", router, "--internal-token", TOKEN]
    argv = ["models", "rollout", DEFAULT, "--weights", "v1=90,v2=10", "--shadow", "v3", "--sticky", "tenant"]
    assert await asyncio.to_thread(main, [*argv, "--auto-rollback", "ttft_ms=300,min_samples=20", *common]) == 0
    out = capsys.readouterr().out
    assert f"{DEFAULT} (default): v1=90, v2=10; primary v1; sticky tenant; shadow v3" in out
    assert "ttft_p99+300ms" in out and "(min 20)" in out
    policy = models.api.models.get(DEFAULT).rollout.policy
    assert dict(policy.weights) == {"v1": 90, "v2": 10} and policy.shadow == "v3" and policy.sticky == "tenant"
    assert await asyncio.to_thread(main, ["models", "rollback", DEFAULT, *common]) == 0
    assert "v1=100, v2=0; primary v1" in capsys.readouterr().out
    assert await asyncio.to_thread(main, ["models", "rollout", DEFAULT, "--weights", "v1=95,v2", *common]) == 2
    assert "must be version=number" in capsys.readouterr().err
    assert await asyncio.to_thread(main, ["models", "rollout", DEFAULT, "--weights", "v7=1", *common]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    view = await gather(router, token=TOKEN)
    console = Console(width=200, record=True)
    console.print(render(view))
    text = console.export_text()
    assert "models:" in text and "other-model: b1=100" in text and "rolled back v2 -> v1" in text
