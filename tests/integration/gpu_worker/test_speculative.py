"""Speculative decoding with the real models: the INT4 edge draft + our forward equal plain greedy decoding;
a cancel reaches a speculative prefill."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from services.common.model_paths import model_paths
from services.common.pb.meshserve.v1.inference_pb2 import FINISH_REASON_CANCELLED
from services.common.settings import load_settings
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.model import LlamaModel
from services.gpu_worker.spec_engine import SpeculativeEngine
from services.gpu_worker.speculative import OgDraft, SpeculativeDecoder, load_draft_model
from services.gpu_worker.startup import start_gpu_worker
from tests.integration.gpu_worker.greedy import greedy
from tests.worker_helpers import cancel_during_prefill, generate, wait_idle, wait_serving

pytestmark = pytest.mark.integration
QUESTIONS = ["Write a short poem about the sea.", "List three tips for writing clean Python code."]
N = 24


def chat(tokenizer: object, text: str) -> list[int]:
    return list(tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids)  # type: ignore[attr-defined]


def test_speculative_greedy_equals_plain_greedy_and_the_draft_rolls_back() -> None:
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    paths = model_paths()
    tokenizer = Tokenizer.from_file(str(paths.hf_dir / "tokenizer.json"))
    model = LlamaModel.load(str(paths.hf_dir), device=torch.device("cpu"), dtype=torch.float32)
    draft_model = load_draft_model(paths.edge_dir, threads=1)
    for question in QUESTIONS:
        _check_one(model, draft_model, chat(tokenizer, question))


def _check_one(model: LlamaModel, draft_model: object, prompt: list[int]) -> None:
    blocks = (len(prompt) + N + 8 + 15) // 16 + 1
    cache = model.new_cache(blocks, 16, torch.float32)
    drafts: list[OgDraft] = []

    def make(ctx: list[int]) -> OgDraft:
        drafts.append(OgDraft(draft_model, ctx, len(prompt) + N + 10))
        return drafts[-1]

    dec = SpeculativeDecoder(lambda segs: model.forward(segs, cache), list(range(blocks)), prompt, N, make, k_max=8)
    out = [dec.next() for _ in range(N)]
    assert out == greedy(model, prompt, N)
    assert dec.drafted > 0 and 0 <= dec.accepted <= dec.drafted and 1 <= dec.k.k <= 8
    held = list(drafts[0]._gen.get_sequence(0))  # the draft's own tokens after its last commit
    assert held == dec.tokens[: len(held)] and len(held) > len(prompt)
    dec.close()


def _sample(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    return value or 0.0


@pytest.fixture(scope="module")
async def workers() -> AsyncIterator[tuple[object, object]]:
    # Prefill chunks of 128 tokens: a long prompt's prefill is several forwards (the cancel test).
    common = dict(
        port=0, threads=1, device="cpu", max_active_sequences=2, kv_budget_bytes=48 << 20, max_step_tokens=128
    )
    plain = await start_gpu_worker(load_settings(GpuWorkerSettings, worker_id="cloud-plain", **common))
    spec = await start_gpu_worker(load_settings(GpuWorkerSettings, worker_id="cloud-spec", speculative=True, **common))
    yield plain, spec
    await spec.stop()
    await plain.stop()


async def test_worker_with_speculation_streams_the_plain_workers_text(workers: tuple[object, object]) -> None:
    from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc

    plain, spec = workers
    assert isinstance(spec.runner.engine, SpeculativeEngine)  # type: ignore[attr-defined]
    tokenizer = spec.runner.engine.tokenizer  # type: ignore[attr-defined]
    prompt = chat(tokenizer, QUESTIONS[0])
    drafted = _sample("meshserve_speculative_draft_tokens_total")
    results = []
    for w in (plain, spec):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{w.port}") as channel:  # type: ignore[attr-defined]
            await wait_serving(channel, "meshserve.internal.v1.Worker")
            stub = worker_pb2_grpc.WorkerStub(channel)
            greedy_turn = await generate(stub, prompt, max_tokens=16)
            sampled = await generate(stub, prompt, max_tokens=8, temperature=0.8, seed=7)  # not speculated
            results.append((greedy_turn.token_ids, greedy_turn.text, sampled.token_ids))
    assert results[1] == results[0] and len(results[0][0]) > 0
    assert _sample("meshserve_speculative_draft_tokens_total") > drafted  # the greedy turn was speculated
    assert 0.0 <= _sample("meshserve_speculative_acceptance_ratio") <= 1.0
    usage = spec.runner.engine.kv_usage()  # type: ignore[attr-defined]
    assert usage.used_bytes == 0  # the speculative sequence gave its KV blocks back


async def test_a_cancel_reaches_a_speculative_prefill_after_the_chunk_in_progress(
    workers: tuple[object, object],
) -> None:
    from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc

    _plain, spec = workers
    engine = spec.runner.engine  # type: ignore[attr-defined]
    assert isinstance(engine, SpeculativeEngine)
    ids = list(engine.tokenizer.encode("river stone cloud " * 200).ids)
    chunks = -(-len(ids) // engine.scheduler.max_step_tokens)
    assert chunks >= 4, len(ids)
    before = engine.prefill_chunks
    async with grpc.aio.insecure_channel(f"127.0.0.1:{spec.port}") as channel:  # type: ignore[attr-defined]
        await wait_serving(channel, "meshserve.internal.v1.Worker")
        stub = worker_pb2_grpc.WorkerStub(channel)
        # Greedy, not resumed: a speculative sequence. Cancelled once its first prefill chunk is done.
        session, final = await cancel_during_prefill(stub, ids, lambda: engine.prefill_chunks > before)
        assert final.finish_reason == FINISH_REASON_CANCELLED and final.completion_tokens == 0
        await session.call.done_writing()
        settled = await wait_idle(stub)
    assert engine.prefill_chunks - before < chunks  # not the whole prefill
    assert settled.kv_used_bytes == 0
