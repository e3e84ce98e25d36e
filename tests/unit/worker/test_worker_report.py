"""Load reports (Worker.Stats): KV view of held chats, engine hooks, bounds; through a real gRPC server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.store.keys import kv_block_hashes
from services.worker.config import WorkerSettings
from services.worker.report import LoadReporter, PrefixHasher
from services.worker.runner import Runner
from services.worker.server import RunningWorker, start_worker
from services.worker.types import KVUsage
from tests.unit.worker.fakes import TOKENIZER, FakeEngine
from tests.worker_helpers import META, generate, stats

BLOCK = 4


class HookedEngine(FakeEngine):
    """An engine with a prefix cache of its own: it reports KV bytes and hot blocks."""

    def __init__(self, hot: list[bytes], *, fail: bool = False) -> None:
        super().__init__()
        self.hot, self.fail = hot, fail

    def kv_usage(self) -> KVUsage | None:
        if self.fail:
            raise RuntimeError("engine hook broke")
        return KVUsage(used_bytes=3 << 20, budget_bytes=4 << 20)

    def hot_prefix_blocks(self, block_tokens: int) -> list[bytes]:
        if self.fail:
            raise RuntimeError("engine hook broke")
        assert block_tokens == BLOCK
        return self.hot


async def serve(engine: FakeEngine, **overrides: Any) -> RunningWorker:
    settings = load_settings(
        WorkerSettings,
        port=0,
        worker_id="w-1",
        model_id="fake-model",
        model_version="v1",
        prefix_block_tokens=BLOCK,
        **overrides,
    )
    return await start_worker(settings, engine, tier="edge")


def _start(prompt: Sequence[int], tenant: str, shareable: bool = False) -> worker_pb2.WorkerRequest:
    return worker_pb2.WorkerRequest(
        start=worker_pb2.WorkerStart(
            prompt_token_ids=list(prompt),
            tenant=tenant,
            shareable_prefix=shareable,
            sampling=pb.SamplingParams(max_tokens=3),
        )
    )


async def test_held_chat_is_reported_as_kv_tokens_and_hot_blocks_in_the_cache_scheme() -> None:
    worker = await serve(FakeEngine(chat=True))
    prompt = TOKENIZER.encode("hello world the sea")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
    try:
        stub = worker_pb2_grpc.WorkerStub(channel)
        call = stub.Generate(metadata=META)
        await call.write(_start(prompt, "acme"))
        generated: list[int] = []
        while not (frame := await call.read()).HasField("final"):
            generated.extend(frame.token_ids)
        report = await stats(stub)
        held = [*prompt, *generated[:-1]]  # the last token's KV is computed by the next step
        assert report.held_sequences == 1
        assert report.kv_tokens == len(held)
        assert report.prefix_block_tokens == BLOCK and report.model_version == "v1"
        expected = kv_block_hashes(
            model_id="fake-model", model_version="v1", tenant="acme", token_ids=held, block_tokens=BLOCK
        )
        assert expected and list(report.hot_prefix_blocks) == expected
        assert report.kv_used_bytes == 0 and report.kv_budget_bytes == 0  # the fake engine reports none
        assert report.prompt_tokens_total == len(prompt)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        after = await stats(stub)  # the stream ended: its chat is freed and no longer hot
        assert (after.held_sequences, after.kv_tokens, list(after.hot_prefix_blocks)) == (0, 0, [])
    finally:
        await channel.close()
        await worker.stop()


async def test_engine_hooks_come_first_and_the_report_is_bounded() -> None:
    engine_hot = [bytes([i]) * 32 for i in range(3)]
    worker = await serve(HookedEngine(engine_hot), max_hot_blocks=3)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
    try:
        stub = worker_pb2_grpc.WorkerStub(channel)
        await generate(stub, TOKENIZER.encode("hello world hello world"), max_tokens=2)
        report = await stats(stub)
        assert list(report.hot_prefix_blocks) == engine_hot  # bound reached by the engine's own cache
        assert (report.kv_used_bytes, report.kv_budget_bytes) == (3 << 20, 4 << 20)
    finally:
        await channel.close()
        await worker.stop()


async def test_a_failing_engine_hook_still_gives_a_report() -> None:
    engine = HookedEngine([], fail=True)
    runner = Runner(engine, max_active=1, max_queue=1)
    report = await LoadReporter(runner, PrefixHasher("fake-model", "v1", BLOCK)).report()
    assert (report.kv_used_bytes, report.hot_prefix_blocks, report.max_active_sequences) == (0, (), 1)


def test_shareable_prefixes_hash_with_the_shared_salt() -> None:
    hasher = PrefixHasher("m", "v", BLOCK)
    tokens = list(range(8))
    assert hasher(tokens, "a", True) == hasher(tokens, "b", True) != hasher(tokens, "a", False)
    assert hasher(tokens, "a", False, limit=1) == hasher(tokens, "a", False)[:1]
