"""A resumed stream whose replay prefill outlasts the router's stall timeout: the new worker's prefill
keepalives keep it in, so the stream completes on it (no second ejection).

Real router, two real worker runtimes (``start_worker``, real gRPC on port 0) over a scripted engine:
the first worker to get the stream stalls after a few tokens (and is ejected); the resumed turn's
prefill of prompt + replayed tokens takes longer than the stall timeout.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from services.common.config import load_settings
from services.common.model_paths import DEFAULT_MODEL_ID
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.tokenizer import Tokenizer
from services.router.config import RouterSettings
from services.router.server import start_router
from services.worker.config import WorkerSettings
from services.worker.server import RunningWorker, start_worker
from services.worker.types import EngineInfo, NewSequence, SequenceOutput
from tests.integration.router.harness import META, TOKEN, wait_serving
from tests.unit.worker.fakes import EOS, VOCAB, ByteTokenizer, FakeEngine

pytestmark = pytest.mark.integration

STALL_TIMEOUT_S = 1.0
REPLAY_PREFILL_S = 2.5  # longer than the stall timeout: simulated model work, not a readiness wait
STALL_AFTER = 3
MAX_TOKENS = 8


class _WideTokenizer(ByteTokenizer):
    """The fake vocabulary, tolerant of the real tokenizer's prompt ids (they decode to nothing)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return super().decode([i for i in ids if i < len(self.vocab)], skip_special_tokens)


class ResumeEngine(FakeEngine):
    """Fresh turns stall after ``STALL_AFTER`` tokens (the whole step hangs: no frame, no keepalive from
    the engine); resumed turns prefill slowly, then run freely."""

    def __init__(self) -> None:
        super().__init__()
        self._info = EngineInfo(DEFAULT_MODEL_ID, 1 << 16, 4096, frozenset({EOS}))
        self._tokenizer = _WideTokenizer(VOCAB)
        self.released = threading.Event()
        self.resumed = 0
        self._stalling: set[int] = set()

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    def add(self, seq: NewSequence) -> None:
        super().add(seq)
        if seq.replay:
            self.resumed += 1
            time.sleep(REPLAY_PREFILL_S)  # the prefill of prompt + replay: blocking model work
            self.live[seq.id].pos = len(seq.replay)  # continue the script where the first worker stopped
        else:
            self._stalling.add(seq.id)

    def step(self) -> list[SequenceOutput]:
        if any(self.live[i].pos >= STALL_AFTER for i in self._stalling & set(self.live)):
            self.released.wait(30)  # a hung worker
        return super().step()


@pytest.fixture
async def workers() -> AsyncIterator[list[tuple[ResumeEngine, RunningWorker]]]:
    running = []
    try:
        for i in range(2):
            engine = ResumeEngine()
            settings = load_settings(
                WorkerSettings, port=0, worker_id=f"edge-{i}", internal_token=TOKEN, queued_keepalive_s=0.2
            )
            running.append((engine, await start_worker(settings, engine, tier="edge")))
        yield running
    finally:
        for engine, worker in running:
            engine.released.set()
            await worker.stop()


async def test_a_resumed_stream_is_not_ejected_while_its_replay_prefills(
    workers: list[tuple[ResumeEngine, RunningWorker]], tokenizer: Tokenizer, redis_url: str
) -> None:
    settings = load_settings(
        RouterSettings,
        edge_workers=",".join(f"127.0.0.1:{w.port}" for _, w in workers),
        redis_url=redis_url,
        internal_token=TOKEN,
        shutdown_grace_s=0,
        health_interval_s=0.2,
        stall_timeout_s=STALL_TIMEOUT_S,
    )
    server, router = await start_router(settings, tokenizer=tokenizer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        await asyncio.wait_for(wait_serving(channel), 10)
        req = pb.GenerateRequest(
            prompt="Resume me",
            sampling=pb.SamplingParams(max_tokens=MAX_TOKENS),
            routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
        )
        stub = inference_pb2_grpc.InferenceStub(channel)
        frames = [f async for f in stub.Generate(req, metadata=META)]
    finally:
        await channel.close()
        await server.stop()
    assert frames[-1].HasField("final")
    final = frames[-1].final
    assert final.route.reason == "failover" and final.usage.completion_tokens == MAX_TOKENS
    assert len([t for f in frames for t in f.token_ids]) == MAX_TOKENS
    resumed_on = next(w for e, w in workers if e.resumed)
    assert final.route.worker_id == resumed_on.servicer.worker_id
    ejected = {r.address: r.ejections for r in router.registry.replicas}
    assert ejected[f"127.0.0.1:{resumed_on.port}"] == 0  # its silent-looking prefill was not a stall
    assert sum(ejected.values()) == 1  # only the hung worker
