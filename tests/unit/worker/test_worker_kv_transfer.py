"""Worker.ImportKV / ExportKV translation over fake engines, through a real gRPC server on port 0."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from services.common.config import load_settings
from services.common.errors import FailedPrecondition, MeshError, Unavailable
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerSettings
from services.worker.kv_transfer import KVExport, KVImport, KVPrefix
from services.worker.server import start_worker
from tests.unit.worker.fakes import TOKENIZER, VOCAB, FakeEngine
from tests.worker_helpers import META


class KVEngine(FakeEngine):
    """A fake engine that declares KV transfer: records prefixes, answers fixed counts or raises."""

    def __init__(self, error: MeshError | None = None) -> None:
        super().__init__()
        self._caps = replace(self._caps, kv_transfer=True)
        self.error = error
        self.prefixes: list[tuple[str, KVPrefix]] = []
        self.threads: list[str] = []

    def import_kv(self, prefix: KVPrefix) -> KVImport:
        return self._answer("import", prefix, KVImport(4, len(prefix.token_ids), 3, 1, 2, redis_unavailable=True))

    def export_kv(self, prefix: KVPrefix) -> KVExport:
        return self._answer("export", prefix, KVExport(4, len(prefix.token_ids), 3, 2, 1))

    def _answer(self, op: str, prefix: KVPrefix, result: KVImport | KVExport) -> KVImport | KVExport:
        self.threads.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        self.prefixes.append((op, prefix))
        return result


async def _stub(engine: FakeEngine) -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    worker = await start_worker(load_settings(WorkerSettings, port=0, worker_id="w-kv"), engine, tier="edge")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
    try:
        yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        await channel.close()
        await worker.stop()


@pytest.fixture
async def kv() -> AsyncIterator[tuple[KVEngine, worker_pb2_grpc.WorkerStub]]:
    engine = KVEngine()
    async for stub in _stub(engine):
        yield engine, stub


PROMPT = TOKENIZER.encode("hello world abc")


async def test_import_translates_the_prefix_and_the_counts(kv: tuple[KVEngine, worker_pb2_grpc.WorkerStub]) -> None:
    engine, stub = kv
    request = worker_pb2.KvPrefixRequest(prompt_token_ids=PROMPT, tenant="acme", shareable_prefix=True)
    response = await stub.ImportKV(request, metadata=META)
    assert engine.prefixes == [("import", KVPrefix(tuple(PROMPT), "acme", True))]
    assert (response.block_tokens, response.prompt_tokens, response.blocks) == (4, len(PROMPT), 3)
    assert (response.blocks_held, response.blocks_imported, response.redis_unavailable) == (1, 2, True)
    assert engine.threads and engine.threads[0] != threading.main_thread().name  # not on the event loop


async def test_export_of_text_uses_the_worker_tokenizer(kv: tuple[KVEngine, worker_pb2_grpc.WorkerStub]) -> None:
    engine, stub = kv
    response = await stub.ExportKV(worker_pb2.KvPrefixRequest(prompt_text="hello world abc"), metadata=META)
    assert engine.prefixes == [("export", KVPrefix(tuple(PROMPT), "", False))]
    assert (response.blocks, response.blocks_written, response.blocks_not_held) == (3, 2, 1)
    assert response.prompt_tokens == len(PROMPT)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (worker_pb2.KvPrefixRequest(), "the prefix is empty"),
        (worker_pb2.KvPrefixRequest(prompt_token_ids=[1], prompt_text="a"), "not both"),
        (worker_pb2.KvPrefixRequest(prompt_token_ids=[1, len(VOCAB)]), f"token id {len(VOCAB)} is out of range"),
        (worker_pb2.KvPrefixRequest(prompt_token_ids=[1] * 64), "the context holds 64"),
    ],
)
async def test_bad_prefixes_are_invalid_argument(
    kv: tuple[KVEngine, worker_pb2_grpc.WorkerStub], request_: worker_pb2.KvPrefixRequest, message: str
) -> None:
    engine, stub = kv
    for call in (stub.ImportKV, stub.ExportKV):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(request_, metadata=META)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")
    assert engine.prefixes == []


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (FailedPrecondition("this cloud worker has no Redis"), grpc.StatusCode.FAILED_PRECONDITION),
        (Unavailable("Redis did not take the KV blocks"), grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_engine_errors_keep_their_status(error: MeshError, code: grpc.StatusCode) -> None:
    async for stub in _stub(KVEngine(error)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ExportKV(worker_pb2.KvPrefixRequest(prompt_token_ids=PROMPT), metadata=META)
        assert (err.value.code(), err.value.details()) == (code, error.message)


async def test_an_engine_without_shareable_kv_is_failed_precondition() -> None:
    async for stub in _stub(FakeEngine()):
        for call in (stub.ImportKV, stub.ExportKV):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(worker_pb2.KvPrefixRequest(prompt_token_ids=PROMPT), metadata=META)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "this edge worker keeps no KV in the shared Redis prefix cache" in (err.value.details() or "")


async def test_calls_without_the_internal_credential_are_refused(
    kv: tuple[KVEngine, worker_pb2_grpc.WorkerStub],
) -> None:
    engine, stub = kv
    for call in (stub.ImportKV, stub.ExportKV):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(worker_pb2.KvPrefixRequest(prompt_token_ids=PROMPT), metadata=(("x-request-id", "t"),))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert engine.prefixes == []
