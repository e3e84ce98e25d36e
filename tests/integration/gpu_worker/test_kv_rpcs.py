"""Worker.ImportKV / ExportKV on real cloud workers (the real small model on CPU) and a real redis-server.

Worker A serves prompts (it exports their KV on finish), worker B starts cold and is pre-warmed by
ImportKV. The Redis is this module's own, because one test stops it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
import pytest
import redis.asyncio as aioredis

from services.cache.admin import CacheAdmin, FlushFilter
from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.server import start_gpu_worker
from services.store.connection import redis_from_url
from services.store.guard import Guard
from services.store.keys import Kind, kv_block_hashes
from services.store.kv_blocks import KVBlockStore, KVContext
from services.worker.server import RunningWorker
from tests.helpers import RedisServer, redis_server
from tests.worker_helpers import META, TurnResult, fold, wait_serving

pytestmark = pytest.mark.integration
BT = 16
TENANT = "acme"


@pytest.fixture(scope="module")
def kv_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


class Replica:
    """One cloud worker and a stub to it."""

    def __init__(self, worker: RunningWorker, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.worker = worker
        self.stub = stub

    @property
    def engine(self) -> CloudEngine:
        engine = self.worker.runner.engine
        assert isinstance(engine, CloudEngine)
        return engine

    async def generate(self, prompt: Sequence[int], tenant: str = TENANT) -> TurnResult:
        """A greedy turn; then waits until its export on finish reached Redis."""
        start = worker_pb2.WorkerStart(
            prompt_token_ids=list(prompt), sampling=inference_pb2.SamplingParams(max_tokens=4), tenant=tenant
        )

        async def frames() -> AsyncIterator[worker_pb2.WorkerRequest]:
            yield worker_pb2.WorkerRequest(start=start)

        result = fold([f async for f in self.stub.Generate(frames(), metadata=META)])
        assert self.engine.redis is not None
        await asyncio.to_thread(self.engine.redis.flush)
        return result

    async def import_kv(self, prompt: Sequence[int], tenant: str = TENANT) -> worker_pb2.KvImportResponse:
        request = worker_pb2.KvPrefixRequest(prompt_token_ids=list(prompt), tenant=tenant)
        return await self.stub.ImportKV(request, metadata=META)

    async def export_kv(self, text: str, tenant: str = TENANT) -> worker_pb2.KvExportResponse:
        request = worker_pb2.KvPrefixRequest(prompt_text=text, tenant=tenant)
        return await self.stub.ExportKV(request, metadata=META)


async def _replica(url: str, name: str) -> AsyncIterator[Replica]:
    settings = load_settings(
        GpuWorkerSettings,
        port=0,
        threads=1,
        device="cpu",
        max_active_sequences=2,
        kv_budget_bytes=32 << 20,
        worker_id=name,
        redis_url=url,
        kv_redis_timeout_s=2.0,
        warmup=False,
    )
    worker = await start_gpu_worker(settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            await wait_serving(channel, "meshserve.internal.v1.Worker")
            yield Replica(worker, worker_pb2_grpc.WorkerStub(channel))
    finally:
        await worker.stop()


@pytest.fixture(scope="module")
async def a(kv_redis: RedisServer) -> AsyncIterator[Replica]:
    async for replica in _replica(kv_redis.url, "cloud-a"):
        yield replica


@pytest.fixture(scope="module")
async def b(kv_redis: RedisServer) -> AsyncIterator[Replica]:
    async for replica in _replica(kv_redis.url, "cloud-b"):
        yield replica


def encode(replica: Replica, text: str) -> list[int]:
    ids = list(replica.engine.tokenizer.encode(text).ids)
    assert len(ids) >= 2 * BT and len(ids) % BT, "the test needs >= 2 full blocks and a partial one"
    return ids


async def stored_blocks(url: str, replica: Replica, ids: Sequence[int], tenant: str = TENANT) -> int:
    """Leading blocks of ``ids`` in Redis, read through services.cache (the KV store's own match)."""
    guard = Guard(redis_from_url(url, 2.0), timeout_s=2.0)
    try:
        store = KVBlockStore(guard, block_tokens=BT, timeout_s=2.0)
        engine = replica.engine
        return await store.match(KVContext(engine.model_id, engine.model_version, tenant), ids)
    finally:
        await guard.close()


async def test_import_prewarms_a_fresh_worker_that_then_reuses_the_blocks_locally(a: Replica, b: Replica) -> None:
    prompt = encode(a, "The history of the river valley and the towns along it is long. " * 3)
    blocks = len(prompt) // BT
    served = await a.generate(prompt)  # A exports the prompt's blocks on finish

    other = await b.import_kv(prompt, tenant="someone-else")  # another tenant's namespace: nothing
    assert (other.blocks, other.blocks_held, other.blocks_imported) == (blocks, 0, 0)

    before = b.engine.prefix_counters()
    imported = await b.import_kv(prompt)
    assert (imported.block_tokens, imported.prompt_tokens, imported.blocks) == (BT, len(prompt), blocks)
    assert (imported.blocks_held, imported.blocks_imported, imported.redis_unavailable) == (0, blocks, False)
    assert b.engine.prefix_counters() == before  # an import is not a request
    hashes = kv_block_hashes(
        model_id=b.engine.model_id,
        model_version=b.engine.model_version,
        tenant=TENANT,
        token_ids=prompt,
        block_tokens=BT,
    )
    report = await b.stub.Stats(worker_pb2.StatsRequest(), metadata=META)
    assert set(hashes) <= set(report.hot_prefix_blocks)  # prefix-aware routing now sees B holds it

    again = await b.import_kv(prompt)
    assert (again.blocks_held, again.blocks_imported) == (blocks, 0)

    result = await b.generate(prompt)
    after = b.engine.prefix_counters()
    reused = blocks * BT
    assert after["local"] - before["local"] == reused
    assert after["redis"] - before["redis"] == 0
    assert after["computed"] - before["computed"] == len(prompt) - reused
    assert result.final is not None and result.final.prefill_tokens == len(prompt) - reused
    assert result.token_ids == served.token_ids


async def test_export_puts_held_blocks_back_in_redis_for_another_worker(
    kv_redis: RedisServer, a: Replica, b: Replica
) -> None:
    text = "Rivers carry water, sand and stories from the mountains down to the sea. " * 3
    prompt = encode(a, text)
    blocks = len(prompt) // BT
    await a.generate(prompt)
    assert await stored_blocks(kv_redis.url, a, prompt) == blocks

    client = aioredis.Redis.from_url(kv_redis.url)
    try:
        flushed = await CacheAdmin(client).flush(FlushFilter(kind=Kind.KV, model_id=a.engine.model_id))
    finally:
        await client.aclose()
    assert flushed >= blocks
    assert await stored_blocks(kv_redis.url, a, prompt) == 0
    cold = await b.import_kv(prompt)
    assert cold.blocks_imported == 0 and not cold.redis_unavailable  # a plain miss: Redis answered

    exported = await a.export_kv(text)  # by text: the worker's tokenizer gives the same ids
    assert (exported.block_tokens, exported.prompt_tokens, exported.blocks) == (BT, len(prompt), blocks)
    assert (exported.blocks_written, exported.blocks_not_held) == (blocks, 0)
    assert await stored_blocks(kv_redis.url, a, prompt) == blocks

    warmed = await b.import_kv(prompt)
    assert (warmed.blocks_held, warmed.blocks_imported) == (0, blocks)

    unknown = await a.export_kv("A prefix this worker never served, long enough for two blocks of KV. " * 2)
    assert unknown.blocks_written == 0 and unknown.blocks_not_held == unknown.blocks >= 2


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (worker_pb2.KvPrefixRequest(tenant=TENANT), "the prefix is empty"),
        (worker_pb2.KvPrefixRequest(prompt_token_ids=[1, 2], prompt_text="hi"), "not both"),
        (worker_pb2.KvPrefixRequest(prompt_token_ids=[1, 10**6]), "token id 1000000 is out of range"),
        (worker_pb2.KvPrefixRequest(prompt_token_ids=[1] * 9000), "the context holds"),
    ],
)
async def test_bad_input_is_invalid_argument(b: Replica, request_: worker_pb2.KvPrefixRequest, message: str) -> None:
    for call in (b.stub.ImportKV, b.stub.ExportKV):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request_, metadata=META)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")


async def test_the_internal_credential_is_required(b: Replica) -> None:
    request = worker_pb2.KvPrefixRequest(prompt_token_ids=[1, 2, 3])
    for call in (b.stub.ImportKV, b.stub.ExportKV):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request, metadata=(("x-meshserve-internal-token", "wrong"),))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_redis_down_imports_nothing_and_export_is_unavailable(
    kv_redis: RedisServer, a: Replica, b: Replica
) -> None:
    text = "Lakes are quiet places where the water rests before it moves on again. " * 3
    prompt = encode(a, text)
    await a.generate(prompt)
    kv_redis.stop()
    try:
        missed = await b.import_kv(prompt)
        assert (missed.blocks_imported, missed.redis_unavailable) == (0, True)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await a.export_kv(text)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis did not take the KV blocks" in (err.value.details() or "")
        served = await b.generate(prompt)  # requests still work: the cache fails open
        assert served.final is not None and served.final.completion_tokens > 0
    finally:
        kv_redis.start()
    # Redis is back (empty): once the guard's circuit breaker lets calls through, export works again.
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            exported = await a.export_kv(text)
            break
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert asyncio.get_running_loop().time() < deadline, "export never recovered after Redis came back"
            await asyncio.sleep(0.2)  # waiting out the breaker's back-off, not readiness
    assert exported.blocks_written == len(prompt) // BT
    assert await stored_blocks(kv_redis.url, a, prompt) == len(prompt) // BT
