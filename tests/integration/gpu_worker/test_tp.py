"""Tensor parallelism with real processes: 3 gloo ranks on 127.0.0.1 give TP=1's greedy tokens, also
after the group has slept (every rank's shard released) and woken.

Two levels: the model (``tp_rank.py`` ranks driving ``LeaderModel``/``follow`` directly) and the
worker as deployed (``torchrun ... -m services.gpu_worker``: rank 0 serves gRPC, the others follow),
one TP=3 worker for the module, with the session's real Redis as its prefix KV store: prefixes cross
between it and a TP=1 engine both ways, on admission and finish and through Worker.ImportKV/ExportKV.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
import torch
from tokenizers import Tokenizer

from benchmarks.engine_stepper import EngineStepper
from services.cache.admin import CacheAdmin, FlushFilter
from services.common.errors import ConfigError
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.processes import ServiceProcess
from services.common.sampling import SamplingParams
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.model import LlamaModel
from services.gpu_worker.prefix import RedisPrefixCache, chain_keys
from services.gpu_worker.tp import RankEnv, check_degree, load_model, model_config
from services.store.keys import Kind
from services.store.kv_blocks import KVContext
from tests.helpers import RedisServer, free_port
from tests.integration.gpu_worker.greedy import greedy
from tests.worker_helpers import META, generate, wait_serving

pytestmark = pytest.mark.integration
MODEL = str(model_paths().hf_dir)
QUESTIONS = ["Name three colours.", "What is the capital of France?"]
MAX_TOKENS = 8
EOS = 2  # SmolLM2's <|im_end|>
VERSION = "tp-prefix"  # the TP=3 worker's and the TP=1 engine's model version: one key scope
BT = 16


def _prompts() -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(model_paths().hf_dir / "tokenizer.json"))
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return [list(tokenizer.encode(chat.format(q)).ids) for q in QUESTIONS]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def single() -> list[list[int]]:
    """TP=1 greedy tokens of PROMPTS: the reference."""
    torch.set_num_threads(1)
    model = LlamaModel.load(MODEL, device=torch.device("cpu"), dtype=torch.float32)
    return [greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def _run_group(world: int, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
        )
        argv = [sys.executable, "-m", "tests.integration.gpu_worker.tp_rank", MODEL, str(max_tokens)]
        argv += [",".join(map(str, p)) for p in prompts]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-2000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    line = next(line for line in outs[0].splitlines() if line.startswith('{"tokens"'))
    return json.loads(line)["tokens"]


def test_tp3_greedy_equals_tp1(single: list[list[int]]) -> None:
    assert _run_group(3, PROMPTS, MAX_TOKENS) == single
    assert all(len(s) == MAX_TOKENS for s in single)


@pytest.fixture(scope="module")
async def tp3(redis_srv: RedisServer) -> AsyncIterator[tuple[ServiceProcess, list[str]]]:
    """The worker as deployed: torchrun, 3 ranks, rank 0 on gRPC, Redis prefix cache on; its log lines."""
    lines: list[str] = []
    env = dict(
        os.environ,
        MESHSERVE_GPU_WORKER_HOST="127.0.0.1",
        MESHSERVE_GPU_WORKER_PORT="0",
        MESHSERVE_GPU_WORKER_THREADS="1",
        MESHSERVE_GPU_WORKER_DEVICE="cpu",
        MESHSERVE_GPU_WORKER_KV_DTYPE="float32",  # the reference keeps float32 KV
        MESHSERVE_GPU_WORKER_KV_BUDGET_BYTES=str(32 << 20),
        MESHSERVE_GPU_WORKER_WORKER_ID="cloud-tp3",
        MESHSERVE_GPU_WORKER_REDIS_URL=redis_srv.url,
        MESHSERVE_GPU_WORKER_MODEL_VERSION=VERSION,
        GLOO_SOCKET_IFNAME="lo",
    )
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=3"]
    proc = ServiceProcess("cloud-tp3", [*argv, "-m", "services.gpu_worker"], env, lambda _n, line: lines.append(line))
    await proc.spawn()
    try:
        await proc.wait_started(240)
        async with grpc.aio.insecure_channel(proc.address) as channel:
            await wait_serving(channel, "meshserve.internal.v1.Worker", timeout_s=120)
        yield proc, lines
    finally:
        await proc.stop(60)


async def test_tp3_worker_under_torchrun_serves_tp1_greedy_over_grpc(
    single: list[list[int]], tp3: tuple[ServiceProcess, list[str]]
) -> None:
    proc, lines = tp3
    async with grpc.aio.insecure_channel(proc.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for prompt, expected in zip(PROMPTS, single, strict=True):
            result = await generate(stub, prompt, max_tokens=MAX_TOKENS)
            expected = expected[: expected.index(EOS)] if EOS in expected else expected  # not streamed
            assert result.token_ids == expected, "\n".join(lines[-20:])


async def test_tp3_worker_batches_concurrent_turns_with_tp1_greedy(
    single: list[list[int]], tp3: tuple[ServiceProcess, list[str]]
) -> None:
    """Turns at once: their rows share packed steps, mirrored by the followers step for step."""
    proc, lines = tp3
    async with grpc.aio.insecure_channel(proc.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        results = await asyncio.gather(*(generate(stub, p, max_tokens=MAX_TOKENS) for p in PROMPTS * 2))
    expected = [s[: s.index(EOS)] if EOS in s else s for s in single] * 2
    assert [r.token_ids for r in results] == expected, "\n".join(lines[-20:])


def _tp1_engine(redis_url: str) -> CloudEngine:
    settings = GpuWorkerSettings()
    redis = RedisPrefixCache(
        redis_url, block_tokens=BT, budget_bytes=64 << 20, ttl_s=60, timeout_s=2.0, max_block_bytes=8 << 20
    )
    return CloudEngine(
        settings.check_model(),
        model_id=settings.model_id,  # the worker's default, as the TP=3 worker has it
        model_version=VERSION,
        device="cpu",
        kv_dtype="float32",
        threads=1,
        kv_budget_bytes=32 << 20,
        redis=redis,
    )


def _engine_greedy(engine: CloudEngine, ids: list[int]) -> list[int]:
    out = EngineStepper(engine).generate(ids, SamplingParams(max_tokens=MAX_TOKENS))  # Redis loads on its I/O thread
    return out[: out.index(EOS)] if EOS in out else out  # as the worker streams it


async def _wait_stored(redis_url: str, engine: CloudEngine, ids: list[int]) -> None:
    """Bounded wait until the worker's background export of ``ids``' reusable blocks reached Redis."""
    ctx = KVContext(engine.model_id, VERSION, "", False)  # the worker's scope for requests without a tenant
    last = chain_keys(ctx, BT, ids)[(len(ids) - 1) // BT - 1]
    client = aioredis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 60
        while not await client.exists(last):
            assert time.monotonic() < deadline, "the TP=3 worker never exported its prefix blocks"
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def test_prefix_blocks_cross_between_tp3_worker_and_tp1_engine_through_redis(
    redis_srv: RedisServer, tp3: tuple[ServiceProcess, list[str]]
) -> None:
    proc, lines = tp3
    engine = await asyncio.to_thread(_tp1_engine, redis_srv.url)
    tokenizer = engine.tokenizer
    story = "The history of the river valley and the towns along it is long and full of change. "
    to_tp3 = list(tokenizer.encode("Summarize: " + story * 6).ids)  # ~100 tokens: 6 reusable blocks
    to_tp1 = list(tokenizer.encode("Translate: " + story * 6).ids)
    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            # TP=1 exports (full-head blocks), the TP=3 worker imports: each rank gets its head slice.
            cold_tp1 = await asyncio.to_thread(_engine_greedy, engine, to_tp3)
            assert engine.prefix_counters() == {"computed": len(to_tp3), "local": 0, "redis": 0}
            assert engine.redis is not None
            await asyncio.to_thread(engine.redis.flush)
            warm = await generate(stub, to_tp3, max_tokens=MAX_TOKENS)
            reusable = (len(to_tp3) - 1) // BT * BT
            assert reusable >= 5 * BT
            assert warm.final is not None and warm.final.prefill_tokens == len(to_tp3) - reusable
            assert warm.token_ids == cold_tp1, "\n".join(lines[-20:])

            # The TP=3 worker exports (slices gathered on rank 0), TP=1 imports: same keys, same layout.
            cold_tp3 = await generate(stub, to_tp1, max_tokens=MAX_TOKENS)
            assert cold_tp3.final is not None and cold_tp3.final.prefill_tokens == len(to_tp1)
            await _wait_stored(redis_srv.url, engine, to_tp1)
            before = engine.prefix_counters()
            assert await asyncio.to_thread(_engine_greedy, engine, to_tp1) == cold_tp3.token_ids
            after = engine.prefix_counters()
            reusable = (len(to_tp1) - 1) // BT * BT
            assert after["redis"] - before["redis"] == reusable
            assert after["computed"] - before["computed"] == len(to_tp1) - reusable
    finally:
        await asyncio.to_thread(engine.close)


async def test_import_and_export_kv_rpcs_on_the_tp3_worker(
    redis_srv: RedisServer, tp3: tuple[ServiceProcess, list[str]]
) -> None:
    """ImportKV scatters full-head blocks over the ranks, ExportKV gathers them back: a round trip of
    TP=1's blocks through the TP=3 worker's cache is bit-exact, and the imported blocks are reused."""
    proc, lines = tp3
    engine = await asyncio.to_thread(_tp1_engine, redis_srv.url)
    story = "The history of the river valley and the towns along it is long and full of change. "
    prompt = list(engine.tokenizer.encode("Describe: " + story * 6).ids)
    blocks = len(prompt) // BT
    ctx = KVContext(engine.model_id, VERSION, "", False)
    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            cold = await asyncio.to_thread(_engine_greedy, engine, prompt)  # TP=1 computes and exports
            assert engine.redis is not None
            await asyncio.to_thread(engine.redis.flush)
            request = worker_pb2.KvPrefixRequest(prompt_token_ids=prompt)
            imported = await stub.ImportKV(request, metadata=META)
            assert (imported.blocks, imported.blocks_imported) == (blocks, blocks), "\n".join(lines[-20:])
            warm = await generate(stub, prompt, max_tokens=MAX_TOKENS)
            reused = min(blocks, (len(prompt) - 1) // BT) * BT
            assert warm.final is not None and warm.final.prefill_tokens == len(prompt) - reused
            assert warm.token_ids == cold

            client = aioredis.Redis.from_url(redis_srv.url)
            try:
                await CacheAdmin(client).flush(FlushFilter(kind=Kind.KV, model_version=VERSION))
            finally:
                await client.aclose()
            assert await asyncio.to_thread(engine.redis.load, ctx, prompt) == []
            exported = await stub.ExportKV(request, metadata=META)
            assert (exported.blocks_written, exported.blocks_not_held) == (blocks, 0)
            with engine.blocks.lock:
                ids = engine.blocks.acquire_prefix(chain_keys(ctx, BT, prompt))
            try:
                local = [engine.cache.read_block(b) for b in ids]
            finally:
                with engine.blocks.lock:
                    engine.blocks.release(ids)
            stored = await asyncio.to_thread(engine.redis.load, ctx, prompt)
            assert len(local) == len(stored) == blocks
            # Redis keeps float16 (kv_codec): TP=1's float32 blocks, rounded once, came back unchanged.
            assert all(torch.equal(x.to(y.dtype), y) for x, y in zip(local, stored, strict=True))
    finally:
        await asyncio.to_thread(engine.close)


def _ranks_rss(proc: ServiceProcess) -> list[int]:
    """Resident bytes of each rank process (torchrun's children), rank 0 first by pid order."""
    assert proc.proc is not None
    children = Path(f"/proc/{proc.proc.pid}/task/{proc.proc.pid}/children").read_text().split()
    page = os.sysconf("SC_PAGE_SIZE")
    return [int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page for pid in sorted(children, key=int)]


async def test_tp3_worker_sleeps_with_its_followers_and_wakes_to_the_same_greedy_tokens(
    single: list[list[int]], tp3: tuple[ServiceProcess, list[str]]
) -> None:
    """Sleep releases every rank's shard and KV (each rank's resident memory drops), Wake loads them
    again: the group answers TP=1's greedy tokens, so the followers' caches were shared again."""
    proc, lines = tp3
    async with grpc.aio.insecure_channel(proc.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        awake = _ranks_rss(proc)
        assert len(awake) == 3
        slept = await stub.Sleep(worker_pb2.SleepRequest(only_if_idle=True), metadata=META)
        assert slept.model_state == worker_pb2.MODEL_STATE_ASLEEP, "\n".join(lines[-20:])
        deadline = time.monotonic() + 60
        while sum('"tp_follower_released"' in line for line in lines) < 2:  # each follower logs its release
            assert time.monotonic() < deadline, "\n".join(lines[-20:])
            await asyncio.sleep(0.05)
        asleep = _ranks_rss(proc)
        assert all(a < 0.5 * b for a, b in zip(asleep, awake, strict=True)), (asleep, awake)
        woke = await stub.Wake(worker_pb2.WakeRequest(), metadata=META)
        assert woke.model_state == worker_pb2.MODEL_STATE_AWAKE, "\n".join(lines[-20:])
        assert sum('"tp_follower_restored"' in line for line in lines) == 2
        for prompt, expected in zip(PROMPTS, single, strict=True):
            result = await generate(stub, prompt, max_tokens=MAX_TOKENS)
            expected = expected[: expected.index(EOS)] if EOS in expected else expected
            assert result.token_ids == expected, "\n".join(lines[-20:])


async def test_tp3_worker_stops_with_its_followers_on_sigterm(tp3: tuple[ServiceProcess, list[str]]) -> None:
    proc, lines = tp3
    await proc.stop(60)
    assert proc.proc is not None and proc.proc.returncode is not None
    assert any('"tp_follower_stopped"' in line for line in lines)  # followers left on rank 0's stop


def test_tp2_is_refused_naming_the_head_counts() -> None:
    config = model_config(MODEL)
    with pytest.raises(ConfigError) as err:
        check_degree(config, 2)
    message = str(err.value)
    assert "9 attention heads" in message and "3 KV heads" in message and "[1, 3]" in message
    check_degree(config, 3)
    with pytest.raises(ConfigError, match="tensor-parallel degree 2"):  # before any process group forms
        load_model(MODEL, device=torch.device("cpu"), dtype=torch.float32, env=RankEnv(rank=0, world=2))
