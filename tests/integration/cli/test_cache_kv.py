"""`meshserve cache import|export` against real cloud workers (the real small model on CPU), real routers
and a real redis-server.

Worker A serves prompts (it exports their KV to Redis on finish); worker B starts cold and is
pre-warmed by `cache import`, found through the router the state file records (B is its only cloud
replica); worker C has no Redis. The Redis is this module's own: one test flushes it, one stops it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from services.cli.cache import main as cache_cli
from services.common.config import load_settings
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import router_admin_pb2, router_admin_pb2_grpc, worker_pb2
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc as wpb_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.serving import RunningServer
from services.common.tokenizer import Tokenizer
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.server import start_gpu_worker
from services.local.state import write_state
from services.router.config import RouterSettings
from services.router.server import start_router
from services.store.connection import redis_from_url
from services.store.guard import Guard
from services.store.kv_blocks import KVBlockStore, KVContext
from services.worker.server import RunningWorker
from tests.helpers import RedisServer, free_port, redis_server
from tests.worker_helpers import META, fold, wait_serving

pytestmark = pytest.mark.integration
BT = 16
TENANT = "acme"
PROG = "meshserve cache"


@dataclass
class Worker:
    running: RunningWorker

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"

    @property
    def engine(self) -> CloudEngine:
        engine = self.running.runner.engine
        assert isinstance(engine, CloudEngine)
        return engine

    async def generate(self, prompt: Sequence[int]) -> int:
        """A greedy turn for TENANT; waits until its export on finish reached Redis. Prompt tokens prefilled."""
        start = worker_pb2.WorkerStart(
            prompt_token_ids=list(prompt), sampling=inference_pb2.SamplingParams(max_tokens=2), tenant=TENANT
        )

        async def frames() -> AsyncIterator[worker_pb2.WorkerRequest]:
            yield worker_pb2.WorkerRequest(start=start)

        async with grpc.aio.insecure_channel(self.address) as channel:
            result = fold([f async for f in wpb_grpc.WorkerStub(channel).Generate(frames(), metadata=META)])
        if self.engine.redis is not None:
            await asyncio.to_thread(self.engine.redis.flush)
        assert result.final is not None
        return int(result.final.prefill_tokens)


async def _start_worker(name: str, redis_url: str) -> Worker:
    settings = load_settings(
        GpuWorkerSettings,
        port=0,
        threads=1,
        device="cpu",
        max_active_sequences=2,
        kv_budget_bytes=32 << 20,
        worker_id=name,
        redis_url=redis_url,
        kv_redis_timeout_s=2.0,
        warmup=False,
    )
    worker = Worker(await start_gpu_worker(settings))
    async with grpc.aio.insecure_channel(worker.address) as channel:
        await wait_serving(channel, "meshserve.internal.v1.Worker")
    return worker


async def _start_router(*workers: Worker) -> RunningServer:
    settings = load_settings(
        RouterSettings,
        cloud_workers=",".join(w.address for w in workers),
        shutdown_grace_s=0,
        health_interval_s=0.2,
    )
    server, _ = await start_router(settings)
    return server


@dataclass
class Mesh:
    redis: RedisServer
    a: Worker
    b: Worker
    c: Worker
    router_b: str
    """A router whose only cloud replica is B."""
    router_ab: str
    """A router with two cloud replicas, A and B."""


@pytest.fixture(scope="module")
def kv_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture(scope="module")
async def mesh(kv_redis: RedisServer) -> AsyncIterator[Mesh]:
    a, b, c = await asyncio.gather(
        _start_worker("cloud-a", kv_redis.url), _start_worker("cloud-b", kv_redis.url), _start_worker("cloud-c", "")
    )
    routers = [await _start_router(b), await _start_router(a, b)]
    try:
        yield Mesh(kv_redis, a, b, c, *(f"127.0.0.1:{r.port}" for r in routers))
    finally:
        for server in routers:
            await server.stop()
        for w in (a, b, c):
            await w.running.stop()


@pytest.fixture
def no_router(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No router from the environment; the state file (none yet) is the test's own."""
    monkeypatch.delenv("MESHSERVE_ROUTER_ADDRESS", raising=False)
    monkeypatch.delenv("MESHSERVE_INTERNAL_TOKEN", raising=False)
    state = tmp_path / "mesh.json"
    monkeypatch.setenv("MESHSERVE_STATE_FILE", str(state))
    return state


_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d\S* \[|\{\")")
"""A log line of the in-process services (console or JSON format), not the command's output."""


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    """Run `meshserve cache ...` in-process: its exit code, stdout lines and stderr lines, without the
    log lines of the in-process workers and routers."""
    capsys.readouterr()
    code = await asyncio.to_thread(cache_cli, list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    out_lines, err_lines = ([line for line in s.splitlines() if not _LOG_LINE.match(line)] for s in (out, err))
    return code, out_lines, err_lines


def encode(text: str) -> list[int]:
    ids = Tokenizer(model_paths().hf_dir).encode(text)
    assert len(ids) >= 2 * BT and len(ids) % BT, "the test needs >= 2 full blocks and a partial one"
    return ids


async def stored_blocks(mesh: Mesh, ids: Sequence[int]) -> int:
    """Leading blocks of ``ids`` in Redis, read through services.cache (the KV store's own match)."""
    guard = Guard(redis_from_url(mesh.redis.url, 2.0), timeout_s=2.0)
    try:
        store = KVBlockStore(guard, block_tokens=BT, timeout_s=2.0)
        return await store.match(KVContext(mesh.a.engine.model_id, mesh.a.engine.model_version, TENANT), ids)
    finally:
        await guard.close()


async def test_import_prewarms_the_only_cloud_worker_of_the_running_mesh(
    mesh: Mesh, no_router: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "The history of the river valley and the towns along it is long and quiet. " * 3
    prompt = encode(text)
    blocks = len(prompt) // BT
    await mesh.a.generate(prompt)
    write_state({"router": mesh.router_b})  # `meshserve up` records its router; B is its one cloud worker

    code, out, err = await cli(capsys, "import", text, "--tenant", TENANT)
    assert (code, err) == (0, [])
    assert out == [
        f"{mesh.b.address}: {len(prompt)} prompt tokens, {blocks} full blocks of {BT}: 0 already held, "
        f"{blocks} imported now from Redis ({blocks} of {blocks} held)"
    ]
    code, out, _ = await cli(capsys, "import", text, "--tenant", TENANT, "--json")
    again = json.loads("\n".join(out))
    assert code == 0 and again["worker"] == mesh.b.address
    assert (again["blocks"], again["blocksHeld"], again["blocksImported"]) == (blocks, blocks, 0)
    assert again["redisUnavailable"] is False

    before = mesh.b.engine.prefix_counters()
    prefilled = await mesh.b.generate(prompt)  # B reuses the imported blocks as local ones
    after = mesh.b.engine.prefix_counters()
    assert after["local"] - before["local"] == blocks * BT and after["redis"] == before["redis"]
    assert prefilled == len(prompt) - blocks * BT


async def test_chat_prompts_are_templated_as_the_router_templates_them(
    mesh: Mesh, no_router: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    question = "Which rivers of the northern plains freeze over in winter, and for how many weeks each year?"
    ids = Tokenizer(model_paths().hf_dir).apply_chat_template([{"role": "user", "content": question}])
    blocks = len(ids) // BT
    await mesh.a.generate(ids)  # as the router sends a Chat turn with this one user message

    code, out, _ = await cli(
        capsys, "--json", "import", question, "--chat", "--tenant", TENANT, "--worker", mesh.b.address
    )
    reply = json.loads("\n".join(out))
    assert code == 0 and reply["promptTokens"] == len(ids) and reply["blocks"] == blocks >= 2
    assert reply["blocksHeld"] + reply["blocksImported"] == blocks and reply["blocksImported"] >= 1

    # The router's own tokenization of that chat prompt (`cache where --chat`) has the same length.
    async with grpc.aio.insecure_channel(mesh.router_b) as channel:
        where = await router_admin_pb2_grpc.RouterAdminStub(channel).PrefixLocation(
            router_admin_pb2.PrefixLocationRequest(
                messages=[inference_pb2.ChatMessage(role="user", content=question)], tier=inference_pb2.TIER_CLOUD
            ),
            metadata=META[:1],
            timeout=30,
        )
    assert where.prompt_tokens == len(ids)


async def test_export_writes_the_held_blocks_back_after_a_flush(
    mesh: Mesh, no_router: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "Rivers carry water, sand and stories from the mountains down to the sea. " * 3
    prompt = encode(text)
    blocks = len(prompt) // BT
    await mesh.a.generate(prompt)
    client = aioredis.Redis.from_url(mesh.redis.url)
    try:
        await client.flushall()
    finally:
        await client.aclose()
    assert await stored_blocks(mesh, prompt) == 0

    code, out, err = await cli(capsys, "export", text, "--tenant", TENANT, "--worker", mesh.a.address)
    assert (code, err) == (0, [])
    assert out == [
        f"{mesh.a.address}: {len(prompt)} prompt tokens, {blocks} full blocks of {BT}: "
        f"{blocks} written to Redis, 0 not held"
    ]
    assert await stored_blocks(mesh, prompt) == blocks

    # Nobody held this prompt's blocks in another tenant's namespace: nothing to write.
    code, out, _ = await cli(capsys, "export", text, "--tenant", "globex", "--worker", mesh.a.address)
    assert code == 0 and out[0].endswith(f"0 written to Redis, {blocks} not held")


async def test_worker_choice_needs_worker_when_the_router_has_several_or_none_is_known(
    mesh: Mesh, no_router: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await cli(capsys, "import", "Hello", "--router", mesh.router_ab)
    assert code == 2 and out == [] and len(err) == 1
    assert "knows 2 cloud workers" in err[0] and "--worker" in err[0]
    assert f"{mesh.a.address} (cloud-a)" in err[0] and f"{mesh.b.address} (cloud-b)" in err[0]

    code, _, err = await cli(capsys, "export", "Hello")  # no --router, no env, no state file
    assert code == 2 and len(err) == 1 and "--worker" in err[0] and "meshserve up" in err[0]


@pytest.mark.parametrize("action", ["import", "export"])
async def test_errors_are_one_line_and_exit_1(
    mesh: Mesh, no_router: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    c, b = mesh.c.address, mesh.b.address
    cases = [
        ((action, "Hello there", "--worker", c), f"worker {c}: FAILED_PRECONDITION: this cloud worker has no Redis"),
        ((action, "", "--worker", b), f"worker {b}: INVALID_ARGUMENT: the prefix is empty"),
        (("--internal-token", "wrong", action, "Hi", "--worker", b), f"worker {b}: PERMISSION_DENIED"),
        ((action, "Hi", "--worker", f"127.0.0.1:{free_port()}", "--timeout", "5"), "UNAVAILABLE"),
    ]
    for argv, message in cases:
        code, out, err = await cli(capsys, *argv)
        assert (code, out, len(err)) == (1, [], 1), argv
        assert err[0].startswith(f"{PROG} {action}: ") and message in err[0], err


async def test_redis_down_import_says_so_and_export_is_unavailable(
    mesh: Mesh, no_router: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "Lakes are quiet places where the water rests before it moves on again. " * 3
    blocks = len(encode(text)) // BT
    mesh.redis.stop()
    try:
        code, out, _ = await cli(capsys, "import", text, "--tenant", TENANT, "--worker", mesh.b.address)
        assert code == 0
        assert out[0].endswith(
            f"0 imported now from Redis (0 of {blocks} held); Redis was unavailable, nothing was read from it"
        )
        await mesh.a.generate(encode(text))  # A holds it; Redis is down, so the export fails
        code, out, err = await cli(capsys, "export", text, "--tenant", TENANT, "--worker", mesh.a.address)
        assert (code, out, len(err)) == (1, [], 1)
        assert f"worker {mesh.a.address}: UNAVAILABLE: Redis did not take the KV blocks" in err[0]
    finally:
        mesh.redis.start()
