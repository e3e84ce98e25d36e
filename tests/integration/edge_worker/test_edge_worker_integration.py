"""The edge worker with the real INT4 model, in-process on port 0 (model loaded once per session)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import onnxruntime_genai as og
import pytest

from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.settings import load_settings
from services.common.worker.app import RunningWorker
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.engine import OgEngine
from services.edge_worker.servicer import start_edge_worker
from tests.integration.worker_cases import WorkerCases, run_as_process
from tests.worker_helpers import wait_serving

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
        engine = edge_worker.runner.engine
        assert isinstance(engine, OgEngine)

        def greedy(ids: list[int], n: int) -> list[int]:
            params = og.GeneratorParams(engine.model)
            params.set_search_options(max_length=len(ids) + n, do_sample=False)
            generator = og.Generator(engine.model, params)
            generator.append_tokens(ids)
            out: list[int] = []
            while not generator.is_done():
                generator.generate_next_token()
                out.append(int(generator.get_next_tokens()[0]))
            return out[:-1] if out and out[-1] in engine.info.eos_token_ids else out

        return greedy


async def test_runs_as_a_process_and_drains_on_sigterm() -> None:
    await run_as_process("services.edge_worker", "MESHSERVE_EDGE_WORKER_")
