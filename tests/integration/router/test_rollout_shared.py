"""Rollout policies shared by router replicas through Redis: two real routers (port 0, one models file)
over the same fake workers and a real redis-server. A change or rollback through one shows on the
other, an automatic rollback by one is written for all, a restarted router resumes the shared
policy, bad policies are INVALID_ARGUMENT naming the field, and with Redis down each router keeps
its last known policy (fails open), refuses changes it could not share, applies a rollback at once
and shares it when Redis is back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as admin_pb
from services.common.pb.meshserve.internal.v1 import router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import SamplingParams
from services.common.serving import RunningServer
from services.common.tokenizer import Tokenizer
from services.router.config import RouterSettings
from services.router.frontend.api import RouterAPI
from services.router.server import start_router_api
from services.router.types import Generation, Routing
from services.store.keys import rollout_key
from tests.helpers import redis_server
from tests.integration.router.fake_worker import FakeWorker, start_fake
from tests.integration.router.harness import HF_DIR, TOKEN, wait_serving

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m-instruct"
MODELS = f"""
models:
  - id: {MODEL}
    versions: [{{name: v1}}, {{name: v2}}, {{name: v3}}]
    rollout: {{weights: {{v1: 100}}}}
"""
ADMIN_META = (("x-meshserve-internal-token", TOKEN),)
SPREAD_S = 3.0
"""A change reaches the other replica well within this (pub/sub: at once; the poll: within 1 s)."""


@dataclass
class Replica:
    api: RouterAPI
    server: RunningServer
    channel: grpc.aio.Channel
    admin: router_admin_pb2_grpc.RouterAdminStub

    async def status(self) -> admin_pb.ModelRollout:
        reply = await self.admin.ListRollouts(admin_pb.ListRolloutsRequest(model=MODEL), metadata=ADMIN_META)
        return reply.models[0]

    async def weights(self) -> dict[str, int]:
        return {w.version: w.weight for w in (await self.status()).weights}

    async def set(self, **weights: int) -> admin_pb.ModelRollout:
        req = admin_pb.SetRolloutRequest(model=MODEL)
        req.weights.extend(admin_pb.VersionWeight(version=v, weight=w) for v, w in weights.items())
        return await self.admin.SetRollout(req, metadata=ADMIN_META)

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop()


Start = Callable[..., Awaitable[Replica]]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(HF_DIR)


@pytest.fixture(scope="module")
async def workers() -> AsyncIterator[dict[str, FakeWorker]]:
    fakes = {
        v: await start_fake(f"w-{v}", pb.TIER_EDGE, TOKEN, model=MODEL, model_version=v, weights=i)
        for i, v in enumerate(("v1", "v2", "v3"))
    }
    yield fakes
    for w in fakes.values():
        assert w.server is not None
        await w.server.stop()


@pytest.fixture
async def start(
    tmp_path: Path, tokenizer: Tokenizer, workers: dict[str, FakeWorker], redis_url: str
) -> AsyncIterator[Start]:
    path = tmp_path / "models.yaml"
    path.write_text(MODELS)
    started: list[Replica] = []

    async def _start(url: str = redis_url) -> Replica:
        settings = load_settings(
            RouterSettings,
            edge_workers=",".join(w.address for w in workers.values()),
            models_file=str(path),
            redis_url=url,
            internal_token=TOKEN,
            shutdown_grace_s=0,
            health_interval_s=0.2,
            collapse_requests=False,
            rollout_store_timeout_s=0.3,
        )
        server, api = await start_router_api(settings, tokenizer=tokenizer, announce=False)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        await asyncio.wait_for(wait_serving(channel), 10)
        deadline = asyncio.get_running_loop().time() + 30
        while sum(1 for r in api.router.registry.replicas if r.healthy and r.report.model_version) < len(workers):
            assert asyncio.get_running_loop().time() < deadline, "the fake workers did not all become healthy"
            await asyncio.sleep(0.05)
        replica = Replica(api, server, channel, router_admin_pb2_grpc.RouterAdminStub(channel))
        started.append(replica)
        return replica

    yield _start
    for replica in started:
        with contextlib.suppress(Exception):
            await replica.stop()


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = SPREAD_S) -> float:
    """Seconds until ``check`` holds (asserts it does within ``within_s``)."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    while not await check():
        assert loop.time() - began < within_s, "the change did not reach the other router replica"
        await asyncio.sleep(0.02)
    return loop.time() - began


async def served_by(replica: Replica) -> str:
    gen = Generation(
        model=MODEL,
        prompt="hello",
        sampling=SamplingParams(max_tokens=1, temperature=0.8),
        routing=Routing(),
        tenant="t",
        request_id="r",
    )
    _, done = await replica.api.complete(gen)
    return done.route.worker_id


def store_up() -> float | None:
    return REGISTRY.get_sample_value("meshserve_router_rollout_store_up")


async def test_a_change_through_one_replica_shows_on_the_other_and_survives_a_restart(start: Start) -> None:
    a, b = await start(), await start()
    assert await a.weights() == await b.weights() == {"v1": 100}  # both start from the models file
    assert (await a.status()).policy_store == "shared" and (await a.status()).policy_epoch == 0
    changed = await a.set(v1=0, v2=100)
    assert changed.policy_epoch == 1 and changed.primary == "v2"
    await eventually(lambda: _has(b, {"v1": 0, "v2": 100}))
    status = await b.status()
    assert (status.policy_epoch, status.primary, status.policy_store) == (1, "v2", "shared")
    assert {await served_by(b) for _ in range(5)} == {"w-v2"}  # b routes by the shared policy
    # A rollback through b goes back to b's primary (v2, the heaviest when the policy was set) on a too.
    await b.admin.SetRollout(
        admin_pb.SetRolloutRequest(model=MODEL, weights=[admin_pb.VersionWeight(version="v3", weight=10)]),
        metadata=ADMIN_META,
    )  # weights v3=10 only: primary v3
    await eventually(lambda: _has(a, {"v3": 10}))
    await a.set(v2=90, v3=10)
    await eventually(lambda: _has(b, {"v2": 90, "v3": 10}))
    rolled = await b.admin.Rollback(admin_pb.RollbackRequest(model=MODEL), metadata=ADMIN_META)
    assert {w.version: w.weight for w in rolled.weights} == {"v2": 100, "v3": 0}
    await eventually(lambda: _has(a, {"v2": 100, "v3": 0}))
    epoch = (await a.status()).policy_epoch
    assert epoch == (await b.status()).policy_epoch == 4
    # A restarted router resumes the shared policy, not the models file's.
    await a.stop()
    again = await start()
    status = await again.status()
    assert ({w.version: w.weight for w in status.weights}, status.policy_epoch) == ({"v2": 100, "v3": 0}, epoch)
    assert {await served_by(again) for _ in range(5)} == {"w-v2"}


async def _has(replica: Replica, weights: dict[str, int]) -> bool:
    return await replica.weights() == weights


async def test_an_automatic_rollback_by_one_replica_is_written_for_all(start: Start) -> None:
    a, b = await start(), await start()
    await a.set(v1=50, v2=50)
    await eventually(lambda: _has(b, {"v1": 50, "v2": 50}))
    # What Rollout.record does when a canary trips the rule (the trigger itself: test_models.py).
    a.api.models.get(MODEL).rollout.rollback("ttft p99 900 ms > primary 100 ms + 300 ms")
    took = await eventually(lambda: _has(b, {"v1": 100, "v2": 0}))
    assert took < SPREAD_S
    assert (await b.status()).policy_epoch == (await a.status()).policy_epoch == 2


async def test_a_notice_lost_is_made_up_by_the_poll(start: Start, redis_url: str) -> None:
    """A policy written without its pub/sub notice (a replica that was resubscribing) is still applied."""
    a = await start()
    client = aioredis.Redis.from_url(redis_url)
    try:
        policy = '{"weights": [["v1", 0], ["v3", 100]], "sticky": "chat", "shadow": null, "primary": "v3"}'
        await client.hset(rollout_key(MODEL), mapping={"epoch": 7, "policy": policy, "by": "test", "reason": "set"})
    finally:
        await client.aclose()
    await eventually(lambda: _has(a, {"v1": 0, "v3": 100}))
    assert (await a.status()).policy_epoch == 7


@pytest.mark.parametrize(
    ("weights", "shadow", "field"),
    [
        ({"v9": 100}, None, "weights: model 'smollm2-135m-instruct' has no version 'v9'"),
        ({"v1": 0, "v2": 0}, None, "weights: those of model"),
        ({"v1": 100}, "v8", "shadow: model"),
    ],
)
async def test_a_bad_policy_is_invalid_argument_naming_the_field_and_changes_nothing(
    start: Start, weights: dict[str, int], shadow: str | None, field: str
) -> None:
    a, b = await start(), await start()
    before = await a.status()
    req = admin_pb.SetRolloutRequest(
        model=MODEL, weights=[admin_pb.VersionWeight(version=v, weight=w) for v, w in weights.items()]
    )
    if shadow is not None:
        req.shadow = shadow
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await a.admin.SetRollout(req, metadata=ADMIN_META)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(field)
    await asyncio.sleep(0.3)
    for replica in (a, b):
        status = await replica.status()
        assert (status.policy_epoch, list(status.weights)) == (before.policy_epoch, list(before.weights))


async def test_with_redis_down_each_router_keeps_its_policy_and_shares_a_rollback_once_it_is_back(
    start: Start,
) -> None:
    with redis_server() as own:
        a, b = await start(own.url), await start(own.url)
        await a.set(v1=50, v2=50)
        await eventually(lambda: _has(b, {"v1": 50, "v2": 50}))
        own.stop()  # an outage (and, without persistence, Redis comes back empty)
        await eventually(lambda: _store(a, "unreachable"))
        assert store_up() == 0
        assert await a.weights() == await b.weights() == {"v1": 50, "v2": 50}  # fails open: last known
        assert {await served_by(a) for _ in range(20)} == {"w-v1", "w-v2"}  # and keeps serving by it
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await a.set(v1=10, v2=90)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "nothing was changed" in (err.value.details() or "")
        assert await a.weights() == {"v1": 50, "v2": 50}
        rolled = await a.admin.Rollback(admin_pb.RollbackRequest(model=MODEL), metadata=ADMIN_META)
        assert {w.version: w.weight for w in rolled.weights} == {"v1": 100, "v2": 0}  # here at once
        assert rolled.policy_store == "pending"
        own.start()
        await eventually(lambda: _has(b, {"v1": 100, "v2": 0}), within_s=10)
        await eventually(lambda: _store(a, "shared"))
        assert store_up() == 1
        # Redis lost its data; the epoch still went up (never below what the replicas held), and both
        # hold the same one (b may have written its policy back first: the rollback came after it).
        await eventually(lambda: _same_epoch(a, b))
        assert (await a.status()).policy_epoch >= 2
        # A router started now gets the shared policy (the rollback), not the models file's.
        c = await start(own.url)
        assert await c.weights() == {"v1": 100, "v2": 0}
        for replica in (a, b, c):
            await replica.stop()


async def test_a_policy_redis_lost_is_written_back_for_routers_started_later(start: Start, redis_url: str) -> None:
    a = await start()
    await a.set(v1=20, v3=80)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.delete(rollout_key(MODEL))  # evicted, or Redis restarted without persistence
        await eventually(lambda: _stored(client))
    finally:
        await client.aclose()
    assert (await a.status()).policy_epoch == 2  # written back above the epoch it held
    later = await start()
    assert await later.weights() == {"v1": 20, "v3": 80}


async def _stored(client: aioredis.Redis) -> bool:
    return bool(await client.exists(rollout_key(MODEL)))


async def _same_epoch(a: Replica, b: Replica) -> bool:
    return (await a.status()).policy_epoch == (await b.status()).policy_epoch


async def _store(replica: Replica, state: str) -> bool:
    return (await replica.status()).policy_store == state


async def test_the_cli_through_one_router_changes_both_and_status_shows_the_epoch(
    start: Start, capsys: pytest.CaptureFixture[str]
) -> None:
    from rich.console import Console

    from services.cli import main
    from services.cli.status import gather, render

    a, b = await start(), await start()
    common = ["--router", f"127.0.0.1:{a.server.port}", "--internal-token", TOKEN]
    argv = ["models", "rollout", MODEL, "--weights", "v1=90,v2=10", *common]
    assert await asyncio.to_thread(main, argv) == 0
    assert "v1=90, v2=10; primary v1; sticky chat; policy epoch 1 (shared)" in capsys.readouterr().out
    await eventually(lambda: _has(b, {"v1": 90, "v2": 10}))
    view = await gather(f"127.0.0.1:{b.server.port}", token=TOKEN)
    console = Console(width=200, record=True)
    console.print(render(view))
    assert "v1=90, v2=10; primary v1; sticky chat; policy epoch 1 (shared)" in console.export_text()
