"""The cloud worker with the real HF checkpoint (torch, CPU here), in-process on port 0.

Running it as a process (`python -m services.gpu_worker`) is covered by the e2e mesh tests; only the
edge worker's process test runs here, to keep this set fast.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1.inference_pb2 import FINISH_REASON_CANCELLED
from services.gpu_worker import embed
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.server import start_gpu_worker
from services.worker.server import RunningWorker
from tests.integration.gpu_worker.waits import wait_kv_freed
from tests.integration.worker_cases import WorkerCases
from tests.worker_helpers import (
    CANCEL,
    META,
    Session,
    cancel_during_prefill,
    generate,
    start_frame,
    stats,
    wait_idle,
    wait_serving,
)

pytestmark = pytest.mark.integration
CHAT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
async def gpu_worker() -> AsyncIterator[RunningWorker]:
    settings = load_settings(
        GpuWorkerSettings,
        port=0,
        threads=1,
        device="cpu",
        max_active_sequences=2,
        kv_budget_bytes=64 << 20,
        worker_id="cloud-test",
    )
    worker = await start_gpu_worker(settings)
    yield worker
    await worker.stop()


@pytest.fixture(scope="session")
def hf_model() -> PreTrainedModel:
    """The checkpoint through transformers itself: the reference our own forward must match."""
    return AutoModelForCausalLM.from_pretrained(GpuWorkerSettings().check_model(), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
async def gpu_stub(gpu_worker: RunningWorker) -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gpu_worker.port}") as channel:
        await wait_serving(channel, "meshserve.internal.v1.Worker")
        yield worker_pb2_grpc.WorkerStub(channel)


class TestGpuWorker(WorkerCases):
    @pytest.fixture
    def stub(self, gpu_stub: worker_pb2_grpc.WorkerStub) -> worker_pb2_grpc.WorkerStub:
        return gpu_stub

    @pytest.fixture
    def tokenizer(self, gpu_worker: RunningWorker) -> object:
        return gpu_worker.runner.engine.tokenizer

    @pytest.fixture
    def prompt(self, tokenizer: object) -> list[int]:
        return list(tokenizer.encode(CHAT).ids)  # type: ignore[attr-defined]

    @pytest.fixture
    def reference(self, gpu_worker: RunningWorker, hf_model: PreTrainedModel) -> object:
        engine = gpu_worker.runner.engine
        assert isinstance(engine, CloudEngine)

        def greedy(ids: list[int], n: int) -> list[int]:
            with torch.inference_mode():
                out = hf_model.generate(  # type: ignore[operator]
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=n,
                )
            tokens = [int(t) for t in out[0, len(ids) :]]
            return tokens[:-1] if tokens and tokens[-1] in engine.info.eos_token_ids else tokens

        return greedy

    async def test_cancel_returns_the_kv_to_the_budget(
        self, stub: worker_pb2_grpc.WorkerStub, prompt: list[int]
    ) -> None:
        session = Session(stub)
        await session.call.write(start_frame(prompt, max_tokens=400))
        await session.read()
        running = await stats(stub)
        assert running.kv_used_bytes > 0 and 0 < running.kv_budget_bytes <= 64 << 20  # whole blocks
        await session.call.write(CANCEL)
        while not (await session.read()).HasField("final"):
            pass
        await session.call.done_writing()
        await wait_idle(stub)
        await wait_kv_freed(stub)  # the stop reaches the engine loop after the step in flight

    async def test_cancel_during_a_long_prefill_stops_it_after_the_step_in_progress(
        self, stub: worker_pb2_grpc.WorkerStub, gpu_worker: RunningWorker, tokenizer: object
    ) -> None:
        engine = gpu_worker.runner.engine
        assert isinstance(engine, CloudEngine)
        ids = list(tokenizer.encode("river stone cloud " * 400).ids)  # type: ignore[attr-defined]
        steps = -(-len(ids) // engine.scheduler.max_step_tokens)
        assert steps >= 3, len(ids)
        before = engine.scheduler.steps_total
        # Cancelled once the first prefill chunk step is done.
        session, final = await cancel_during_prefill(stub, ids, lambda: engine.scheduler.steps_total > before)
        assert final.finish_reason == FINISH_REASON_CANCELLED and final.completion_tokens == 0
        await session.call.done_writing()
        await wait_idle(stub)
        await wait_kv_freed(stub)
        assert engine.scheduler.steps_total - before < steps  # not the whole prefill

    async def test_repeated_prompt_prefills_only_what_is_not_cached(
        self, stub: worker_pb2_grpc.WorkerStub, tokenizer: object
    ) -> None:
        ids = list(tokenizer.encode("Tell me about rivers. " * 12).ids)  # type: ignore[attr-defined]
        first = await generate(stub, ids, max_tokens=3)
        second = await generate(stub, ids, max_tokens=3)
        assert second.token_ids == first.token_ids
        assert first.final is not None and first.final.prefill_tokens == len(ids)
        assert second.final is not None and second.final.prefill_tokens == len(ids) - (len(ids) - 1) // 16 * 16


async def test_kv_import_and_export_need_redis(gpu_stub: worker_pb2_grpc.WorkerStub) -> None:
    """This worker runs without a Redis URL: Worker.ImportKV / ExportKV have nothing to move KV with."""
    request = worker_pb2.KvPrefixRequest(prompt_text="Tell me about rivers. " * 4)
    for call in (gpu_stub.ImportKV, gpu_stub.ExportKV):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request, metadata=META)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "this cloud worker has no Redis for its KV prefix cache" in (err.value.details() or "")


EMBED_INPUTS = [[504, 3092, 282, 253, 1789], [19556], list(range(100, 124))]


def test_embedding_pooling_matches_transformers(gpu_worker: RunningWorker, hf_model: PreTrainedModel) -> None:
    """Mean of the last hidden state after the final norm (transformers' ``last_hidden_state``), one padded
    batch: padding changes nothing."""
    engine = gpu_worker.runner.engine
    assert isinstance(engine, CloudEngine)
    pooled = engine.model.pooled(EMBED_INPUTS)
    for row, ids in enumerate(EMBED_INPUTS):
        with torch.inference_mode():
            reference = hf_model.model(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
        torch.testing.assert_close(pooled[row], reference, atol=2e-4, rtol=1e-4)


async def test_worker_embed_batched_equals_one_by_one(gpu_stub: worker_pb2_grpc.WorkerStub) -> None:
    """Worker.Embed over gRPC: unit vectors, one per input; a batch (also cut into several forwards)
    gives the vectors the inputs give alone; ``dimensions`` truncates and re-normalises."""

    async def embed(inputs: list[list[int]], dimensions: int = 0) -> torch.Tensor:
        request = worker_pb2.WorkerEmbedRequest(
            inputs=[worker_pb2.EmbedTokens(token_ids=ids) for ids in inputs], dimensions=dimensions
        )
        reply = await gpu_stub.Embed(request, metadata=META)
        assert reply.prompt_tokens == sum(len(ids) for ids in inputs)
        return torch.tensor([list(e.values) for e in reply.embeddings])

    batch = await embed(EMBED_INPUTS)
    assert batch.shape == (len(EMBED_INPUTS), 576)
    torch.testing.assert_close(batch.norm(dim=-1), torch.ones(len(EMBED_INPUTS)))
    alone = torch.cat([await embed([ids]) for ids in EMBED_INPUTS])
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=1e-5)
    short = await embed(EMBED_INPUTS[:1], dimensions=64)
    torch.testing.assert_close(short[0], torch.nn.functional.normalize(batch[0, :64], dim=0), atol=1e-5, rtol=1e-5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await embed([[1], []])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[1] has no tokens" in (err.value.details() or "")


def test_embedding_batches_cut_by_padded_tokens(gpu_worker: RunningWorker) -> None:
    engine = gpu_worker.runner.engine
    assert isinstance(engine, CloudEngine)
    whole = torch.tensor(embed.embed(engine.model, EMBED_INPUTS))
    split = torch.tensor(embed.embed(engine.model, EMBED_INPUTS, batch_tokens=24))  # three forwards
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
