"""Speculative decoding with the real models: the INT4 edge draft + our forward equal plain greedy decoding,
in the decoder alone and through a speculative CloudEngine stepped as the engine loop steps it (beside
batched sequences, falling back to the scheduler when the KV budget is short, n choices); a cancel
reaches a speculative prefill."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from benchmarks.engine_stepper import EngineStepper
from services.common.config import load_settings
from services.common.generation import FinishReason
from services.common.model_paths import model_paths
from services.common.pb.meshserve.v1.inference_pb2 import FINISH_REASON_CANCELLED
from services.common.sampling import SamplingParams
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.model import LlamaModel
from services.gpu_worker.server import start_gpu_worker
from services.gpu_worker.speculative import OgDraft, SpeculativeDecoder, load_draft_model
from tests.integration.gpu_worker.greedy import greedy
from tests.integration.gpu_worker.test_cloud_engine import STORY, engine
from tests.integration.gpu_worker.test_cloud_engine import generate as alone
from tests.integration.gpu_worker.waits import wait_kv_freed
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
    out: list[int] = []
    while not dec.finished:
        out += dec.advance()  # one unit per engine step: the prefill, then draft-and-verify rounds
    assert out == greedy(model, prompt, N)
    assert dec.drafted > 0 and 0 <= dec.accepted <= dec.drafted and 1 <= dec.k.k <= 8
    held = list(drafts[0]._gen.get_sequence(0))  # the draft's own tokens after its last commit
    assert held == dec.tokens[: len(held)] and len(held) > len(prompt)
    dec.close()


def live(e: CloudEngine) -> dict[int, object]:
    assert e.speculation is not None
    return e.speculation.live  # type: ignore[return-value]


def chunks_of(e: CloudEngine) -> int:
    assert e.speculation is not None
    return e.speculation.prefill_chunks


@pytest.fixture(scope="module")
def spec_engine() -> Iterator[CloudEngine]:
    """A speculative engine whose KV budget holds one speculative sequence (of this module's sizes) and
    one more sequence of the scheduler's: 20 blocks of 16 tokens."""
    e = engine(kv_budget_bytes=20 * 368_640)
    e.speculate(load_draft_model(model_paths().edge_dir, threads=1))
    assert e.blocks.num_blocks == 20
    yield e
    e.close()


def test_speculative_sequences_step_beside_batched_ones_and_equal_plain_greedy(spec_engine: CloudEngine) -> None:
    cloud = spec_engine
    prompts = [chat(cloud.tokenizer, q) for q in QUESTIONS]
    want = [alone(cloud, p, N) for p in prompts]  # the scheduler alone
    driver = EngineStepper(spec_engine)
    greedy_ids = [driver.add(p, SamplingParams(max_tokens=N)) for p in prompts[:1]]
    assert set(greedy_ids) <= set(live(spec_engine))  # speculative
    logprobs = driver.add(prompts[1], SamplingParams(max_tokens=N, logprobs=True))  # the scheduler's
    assert logprobs not in live(spec_engine)
    done = driver.run([*greedy_ids, logprobs])
    assert [done[i].tokens for i in (*greedy_ids, logprobs)] == want
    assert done[greedy_ids[0]].prefill_tokens == len(prompts[0])
    assert done[greedy_ids[0]].steps < N  # some rounds gave several tokens
    assert spec_engine.kv_usage().used_bytes == 0 and spec_engine.next_step_in() is None


def test_a_greedy_sequence_waits_in_the_scheduler_when_the_kv_budget_is_short(spec_engine: CloudEngine) -> None:
    cloud = spec_engine
    prompt = chat(cloud.tokenizer, QUESTIONS[0])
    driver = EngineStepper(spec_engine)
    first = driver.add(prompt, SamplingParams(max_tokens=N))  # speculative: its blocks taken at add
    assert first in live(spec_engine)
    held = spec_engine.blocks.num_blocks - spec_engine.blocks.available
    # Another that needs more than what is left but fits the budget: the scheduler queues it.
    big = SamplingParams(max_tokens=(spec_engine.blocks.num_blocks - held + 1) * 16 - len(prompt))
    second = driver.add(prompt, big)
    assert second not in live(spec_engine)
    driver.run_until(first, 2)
    assert not driver.results[second].tokens  # it waits for the speculative sequence's blocks
    done = driver.run([first, second])
    assert done[first].tokens == alone(cloud, prompt, N)
    assert done[second].tokens[: len(done[first].tokens)] == done[first].tokens
    assert spec_engine.kv_usage().used_bytes == 0


def test_greedy_choices_of_one_prompt_share_the_schedulers_prefill(spec_engine: CloudEngine) -> None:
    """n choices: the first is added alone (it would be speculated), then its forks: it goes to the
    scheduler, whose forks share its prefill."""
    cloud = spec_engine
    prompt = chat(cloud.tokenizer, QUESTIONS[1])
    driver = EngineStepper(spec_engine)
    forks = cloud.scheduler.forks_made
    seqs = driver.choices(prompt, SamplingParams(max_tokens=8, n=2), 2)
    assert not set(seqs) & set(live(spec_engine))
    done = driver.run(seqs)
    assert cloud.scheduler.forks_made - forks == 1
    assert [done[i].tokens for i in seqs] == [alone(cloud, prompt, 8)] * 2
    assert spec_engine.kv_usage().used_bytes == 0


def test_a_stop_during_a_speculative_prefill_ends_it_after_one_chunk(spec_engine: CloudEngine) -> None:
    ids = list(spec_engine.tokenizer.encode("Speculate. " + STORY * 8).ids)  # ~140 tokens: 3 chunks of 64
    driver = EngineStepper(spec_engine)
    seq = driver.add(ids, SamplingParams(max_tokens=4))
    assert seq in live(spec_engine)
    chunks = chunks_of(spec_engine)
    driver.step()
    assert chunks_of(spec_engine) - chunks == 1
    driver.stop(seq)
    assert spec_engine.kv_usage().used_bytes == 0 and spec_engine.next_step_in() is None
    assert chunks_of(spec_engine) - chunks == 1 and not driver.results[seq].tokens
    again = driver.add(ids, SamplingParams(max_tokens=4))
    assert driver.run([again])[again].finish in (FinishReason.LENGTH, FinishReason.STOP)


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
    assert spec.runner.engine.speculation is not None  # type: ignore[attr-defined]
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
    assert engine.speculation is not None
    ids = list(engine.tokenizer.encode("river stone cloud " * 200).ids)
    chunks = -(-len(ids) // engine.scheduler.max_step_tokens)
    assert chunks >= 4, len(ids)
    before = engine.speculation.prefill_chunks
    async with grpc.aio.insecure_channel(f"127.0.0.1:{spec.port}") as channel:  # type: ignore[attr-defined]
        await wait_serving(channel, "meshserve.internal.v1.Worker")
        stub = worker_pb2_grpc.WorkerStub(channel)
        # Greedy, not resumed: a speculative sequence. Cancelled once its first prefill chunk is done.
        session, final = await cancel_during_prefill(stub, ids, lambda: engine.speculation.prefill_chunks > before)
        assert final.finish_reason == FINISH_REASON_CANCELLED and final.completion_tokens == 0
        await session.call.done_writing()
        await wait_idle(stub)
        await wait_kv_freed(stub)  # the stop reaches the engine after the chunk in flight
    assert engine.speculation.prefill_chunks - before < chunks  # not the whole prefill
