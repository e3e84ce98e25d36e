"""The edge worker with the real INT4 model, in-process on port 0 (model loaded once per session)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.config import load_settings
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.sampling import SamplingParams
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.ort_engine import OrtEngine
from services.edge_worker.server import start_edge_worker
from services.worker.server import RunningWorker
from services.worker.types import Engine, NewSequence
from tests.integration.worker_cases import WorkerCases, run_as_process
from tests.worker_helpers import Session, stats, wait_serving

pytestmark = pytest.mark.integration
CHAT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
async def edge_worker() -> AsyncIterator[RunningWorker]:
    settings = load_settings(EdgeWorkerSettings, port=0, threads=1, max_active_sequences=2, worker_id="edge-test")
    worker = await start_edge_worker(settings)
    yield worker
    await worker.stop()


@pytest.fixture(scope="session")
async def edge_stub(edge_worker: RunningWorker) -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{edge_worker.port}") as channel:
        await wait_serving(channel, "meshserve.internal.v1.Worker")
        yield worker_pb2_grpc.WorkerStub(channel)


_ids = itertools.count(10**12)  # never the runner's ids


def on_engine_loop(worker: RunningWorker, *turns: tuple[list[int], int, bool]) -> list[list[int]]:
    """Greedy turns run one after the other on the worker's own engine, on its engine loop thread
    between two of its steps (only that thread may add and step): ``(ids, max_tokens, reuse)``, where
    ``reuse`` continues the previous turn's held sequence (a chat). Trailing EOS dropped. The worker
    must be idle: a step here would take the outputs of its own sequences."""

    def run(engine: Engine) -> list[list[int]]:
        out: list[list[int]] = []
        held: int | None = None
        for ids, max_tokens, reuse in turns:
            seq = NewSequence(next(_ids), tuple(ids), SamplingParams(max_tokens=max_tokens), hold=True)
            seq.reuse = held if reuse else None
            engine.add(seq)
            tokens: list[int] = []
            finished = False
            while not finished:
                for output in engine.step():
                    assert output.id == seq.id, "the worker is not idle"
                    if output.error is not None:
                        raise output.error
                    tokens += output.tokens
                    finished = output.finish is not None
            if held is not None and not reuse:
                engine.stop(held)
            held = seq.id
            eos = engine.info.eos_token_ids
            out.append(tokens[:-1] if tokens and tokens[-1] in eos else tokens)
        if held is not None:
            engine.stop(held)
        return out

    result = worker.runner.loop.call(run).result(timeout=120)
    assert isinstance(result, list)
    return result


def replay_chat(worker: RunningWorker, prompt: list[int], n1: int, context: list[int], n2: int) -> list[int]:
    """Turn 2's greedy tokens computed as the worker must: one engine sequence, turn 1's KV reused.

    A decode step and a prefill round differently in the INT4 kernels (int8 activations), so reused
    KV is not bit-identical to prefilling the whole context again (docs/edge.md): the reference
    runs the same operations on the engine directly.
    """
    return on_engine_loop(worker, (prompt, n1, False), (context, n2, True))[1]


class TestEdgeWorker(WorkerCases):
    @pytest.fixture
    def stub(self, edge_stub: worker_pb2_grpc.WorkerStub) -> worker_pb2_grpc.WorkerStub:
        return edge_stub

    @pytest.fixture
    def tokenizer(self, edge_worker: RunningWorker) -> object:
        return edge_worker.runner.engine.tokenizer

    @pytest.fixture
    def prompt(self, tokenizer: object) -> list[int]:
        return list(tokenizer.encode(CHAT).ids)  # type: ignore[attr-defined]

    @pytest.fixture
    def reference(self, edge_worker: RunningWorker) -> object:
        assert isinstance(edge_worker.runner.engine, OrtEngine)

        def greedy(ids: list[int], n: int) -> list[int]:
            return on_engine_loop(edge_worker, (ids, n, False))[0]

        return greedy

    async def test_two_turns_on_one_stream(  # type: ignore[override]
        self, stub: worker_pb2_grpc.WorkerStub, prompt: list[int], edge_worker: RunningWorker
    ) -> None:
        engine = edge_worker.runner.engine
        assert isinstance(engine, OrtEngine)
        session = Session(stub)
        first = await session.turn(prompt, max_tokens=4)
        context = [*prompt, *first.token_ids, *prompt[-3:]]
        second = await session.turn(context, max_tokens=4)
        await session.call.done_writing()
        assert await session.call.read() is grpc.aio.EOF
        assert second.sequences[0] == 0
        assert second.final is not None and second.final.prompt_tokens == len(context)
        assert second.final.prefill_tokens == 4  # the last generated token + 3 new ones
        assert second.token_ids == await asyncio.to_thread(replay_chat, edge_worker, prompt, 4, context, 4)


async def test_runs_as_a_process_and_drains_on_sigterm() -> None:
    await run_as_process("services.edge_worker", "MESHSERVE_EDGE_WORKER_")


async def test_chat_turn_two_prefills_only_its_new_tokens(
    edge_worker: RunningWorker, edge_stub: worker_pb2_grpc.WorkerStub
) -> None:
    engine = edge_worker.runner.engine
    assert isinstance(engine, OrtEngine)
    prompt = list(engine.tokenizer.encode(CHAT).ids)
    follow_up = list(engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd two animals?<|im_end|>\n").ids)
    session = Session(edge_stub)
    first = await session.turn(prompt, max_tokens=6)
    assert first.final is not None and first.final.prefill_tokens == len(prompt)
    before = await stats(edge_stub)
    context = [*prompt, *first.token_ids, *follow_up]
    second = await session.turn(context, max_tokens=6)
    after = await stats(edge_stub)
    assert second.final is not None
    # The last generated token has no KV yet (it would be the input of the next step): it runs again.
    new_tokens = len(follow_up) + 1
    assert second.final.prefill_tokens == new_tokens
    assert after.prefill_tokens_total - before.prefill_tokens_total == new_tokens
    assert second.final.prompt_tokens == len(context)
    assert second.token_ids == await asyncio.to_thread(replay_chat, edge_worker, prompt, 6, context, 6)
    # A turn that edits history rewinds to the common prefix and prefills the rest.
    edited = [*prompt[:-2], *follow_up]
    third = await session.turn(edited, max_tokens=2)
    assert third.final is not None and third.final.prefill_tokens == len(follow_up)
    assert edge_worker.runner.sessions.held >= 1
    await session.call.done_writing()
    assert await session.call.read() is grpc.aio.EOF
    assert edge_worker.runner.sessions.held == 0  # the stream's KV is freed when it ends


async def test_the_og_engine_still_serves_when_chosen() -> None:
    from services.edge_worker.og_engine import OgEngine
    from tests.worker_helpers import generate

    settings = load_settings(EdgeWorkerSettings, port=0, threads=1, engine="og", worker_id="edge-og", warmup=False)
    worker = await start_edge_worker(settings)
    try:
        assert isinstance(worker.runner.engine, OgEngine)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            await wait_serving(channel, "meshserve.internal.v1.Worker")
            prompt = list(worker.runner.engine.tokenizer.encode(CHAT).ids)
            stub = worker_pb2_grpc.WorkerStub(channel)
            result = await generate(stub, prompt, max_tokens=3)
            assert len(result.token_ids) == 3
            # og applies repetition_penalty itself (the chat default); the other penalties are refused
            penalised = await generate(stub, prompt, max_tokens=3, repetition_penalty=1.15)
            assert len(penalised.token_ids) == 3
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(stub, prompt, max_tokens=3, frequency_penalty=0.5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "applies no frequency_penalty" in (err.value.details() or "")
    finally:
        await worker.stop()


async def test_kv_import_and_export_are_failed_precondition(edge_stub: worker_pb2_grpc.WorkerStub) -> None:
    """The ONNX engine keeps no KV in the shared Redis prefix cache (Worker.ImportKV / ExportKV)."""
    from tests.worker_helpers import META

    request = worker_pb2.KvPrefixRequest(prompt_text="Name three colours.")
    for call in (edge_stub.ImportKV, edge_stub.ExportKV):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request, metadata=META)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "this edge worker keeps no KV in the shared Redis prefix cache" in (err.value.details() or "")


async def test_embed_is_failed_precondition(edge_stub: worker_pb2_grpc.WorkerStub) -> None:
    """The INT4 graph has no pooled hidden states: embeddings are the cloud tier's."""
    from tests.worker_helpers import META

    request = worker_pb2.WorkerEmbedRequest(inputs=[worker_pb2.EmbedTokens(token_ids=[1, 2])])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await edge_stub.Embed(request, metadata=META)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not serve embeddings" in (err.value.details() or "")
