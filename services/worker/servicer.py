"""Generic ``meshserve.internal.v1.Worker`` servicer over a :class:`Runner` (any engine).

Translation only: protobuf frames -> :class:`GenerationRequest` -> runner events -> protobuf frames.
One task reads the router's frames (starts are queued as turns, a cancel stops the turn in flight);
the handler streams the turns in order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import structlog

from services.common import logprobs_pb, metrics, model_state_pb, sampling_pb
from services.common.errors import FailedPrecondition, InvalidArgument, MeshError, ResourceExhausted
from services.common.generation import Final, FinishReason, GenerationRequest
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.sampling import DEFAULT_MAX_TOKENS
from services.worker import kv_transfer
from services.worker.mux import MuxCalls
from services.worker.report import LoadReport, LoadReporter, PrefixHasher
from services.worker.runner import Runner, Turn
from services.worker.sessions import ChatSession
from services.worker.sleep import Transition
from services.worker.types import check_sampling, validate_prompt

log = structlog.get_logger(__name__)
_TIERS = {"edge": inference_pb2.TIER_EDGE, "cloud": inference_pb2.TIER_CLOUD}
MAX_QUEUED_STARTS = 8
"""Turn starts one Generate stream may send ahead of the turn in progress (the router sends one at a
time). One more stops reading the stream and ends it with RESOURCE_EXHAUSTED once that turn ends."""


@dataclass
class _Stream:
    """Per-RPC state shared by the reader task and the handler."""

    starts: asyncio.Queue[worker_pb2.WorkerStart | None] = field(default_factory=asyncio.Queue)
    turn: Turn | None = None
    cancel_next: bool = False
    session: ChatSession | None = None
    """KV kept between this stream's turns (chat), freed when the stream ends."""
    overflow: bool = False
    """The peer sent more than MAX_QUEUED_STARTS starts ahead: the stream ends instead of the next turn."""


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """The Worker service: Generate, Stats, ImportKV, ExportKV, Embed, Sleep, Wake. ``tier`` is "edge" or "cloud".

    The router's streams do not come as Generate calls but over the stream transport
    (services/worker/mux_tcp.py), which runs :meth:`Generate` per stream.
    """

    def __init__(
        self,
        runner: Runner,
        *,
        service: str,
        tier: str,
        worker_id: str,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        reporter: LoadReporter | None = None,
        first_token_delay_s: float = 0.0,
    ) -> None:
        self.runner = runner
        self.service = service
        self.tier = tier
        self.worker_id = worker_id
        self.default_max_tokens = default_max_tokens
        self.mux_calls = MuxCalls(hold=runner.engine.hold_background if runner.capabilities.background else None)
        """The stream transport's connections being served (drained when the worker stops)."""
        self.stream_port = 0
        """Port of the worker's stream transport (services/worker/mux_tcp.py), announced in the load report."""
        self.reporter = reporter or LoadReporter(runner, PrefixHasher(runner.engine.info.model_id, "", 16))
        self.first_token_delay_s = first_token_delay_s
        """Fault injection (``WorkerSettings.fault_first_token_delay_s``): 0 is off."""
        # The labelled series every turn writes, looked up once (a label lookup per frame measurably cost).
        self._ttft = metrics.TTFT.labels(service, tier)
        self._inter_token = metrics.INTER_TOKEN.labels(service, tier)
        self._tokens_in = metrics.TOKENS.labels(service, tier, "input")
        self._tokens_out = metrics.TOKENS.labels(service, tier, "output")

    def register(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(self, server)

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        return await self.stats()

    async def stats(self) -> worker_pb2.WorkerStats:
        """The current load report as ``WorkerStats`` (Stats answers it, heartbeats push it)."""
        return self.stats_pb(await self.reporter.report())

    def stats_pb(self, r: LoadReport) -> worker_pb2.WorkerStats:
        snap = r.counters
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id,
            tier=_TIERS[self.tier],
            model=self.runner.engine.info.model_id,
            active_sequences=r.active_sequences,
            queue_depth=r.queue_depth,
            max_active_sequences=r.max_active_sequences,
            sequences_started_total=snap.sequences_started_total,
            sequences_cancelled_total=snap.sequences_cancelled_total,
            tokens_generated_total=snap.tokens_generated_total,
            prefill_tokens_total=snap.prefill_tokens_total,
            recent_tokens_per_second=snap.recent_tokens_per_second,
            kv_used_bytes=r.kv_used_bytes,
            kv_budget_bytes=r.kv_budget_bytes,
            kv_tokens=r.kv_tokens,
            held_sequences=r.held_sequences,
            prefix_block_tokens=r.prefix_block_tokens,
            hot_prefix_blocks=r.hot_prefix_blocks,
            model_version=r.model_version,
            prompt_tokens_total=snap.prompt_tokens_total,
            stream_port=self.stream_port,
            build=self.build(r.model_version),
            model_state=model_state_pb.to_pb(r.model_state),
            resident_bytes=r.resident_bytes,
        )

    async def Sleep(
        self, request: worker_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ModelStateReply:
        return _state_reply(await self.runner.model.sleep(request.only_if_idle))

    async def Wake(
        self, request: worker_pb2.WakeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ModelStateReply:
        """A cancelled call is this caller going away (its task is cancelled inside ``wake``)."""
        return _state_reply(await self.runner.model.wake())

    def build(self, model_version: str) -> str:
        """``WorkerStats.build``: model id and version, then the engine's own build ("" when it has none)."""
        info = self.runner.engine.info
        return f"{info.model_id}@{model_version or '-'}/{info.build}" if info.build else ""

    async def ImportKV(
        self, request: worker_pb2.KvPrefixRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvImportResponse:
        r = await self._kv("import", request)
        assert isinstance(r, kv_transfer.KVImport)
        return worker_pb2.KvImportResponse(
            block_tokens=r.block_tokens,
            prompt_tokens=r.prompt_tokens,
            blocks=r.blocks,
            blocks_held=r.held,
            blocks_imported=r.imported,
            redis_unavailable=r.redis_unavailable,
        )

    async def ExportKV(
        self, request: worker_pb2.KvPrefixRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvExportResponse:
        r = await self._kv("export", request)
        assert isinstance(r, kv_transfer.KVExport)
        return worker_pb2.KvExportResponse(
            block_tokens=r.block_tokens,
            prompt_tokens=r.prompt_tokens,
            blocks=r.blocks,
            blocks_written=r.written,
            blocks_not_held=r.not_held,
        )

    async def _kv(
        self, op: kv_transfer.Op, request: worker_pb2.KvPrefixRequest
    ) -> kv_transfer.KVImport | kv_transfer.KVExport:
        """Redis I/O and the engine's scheduler hand-off block: the whole call runs in a thread (the
        model woken if asleep, and kept awake while it runs)."""
        model = self.runner.model
        call = await model.use()
        try:
            return await asyncio.to_thread(
                kv_transfer.run,
                self.runner.engine,
                op,
                token_ids=tuple(request.prompt_token_ids),
                text=request.prompt_text,
                tenant=request.tenant,
                shareable=request.shareable_prefix,
                tier=self.tier,
            )
        finally:
            model.release_call(call)

    async def Embed(
        self, request: worker_pb2.WorkerEmbedRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerEmbedResponse:
        """Pooled embeddings from an engine that serves them (the cloud engine), in a thread."""
        if not self.runner.capabilities.embeddings:
            raise FailedPrecondition(
                f"this {self.tier} worker does not serve embeddings (its engine has no pooled hidden states);"
                " send Embed to a cloud worker"
            )
        inputs = [tuple(item.token_ids) for item in request.inputs]
        began = time.perf_counter()
        labels = {"service": self.service, "tier": self.tier}
        call = await self.runner.model.use()  # woken if asleep, and kept awake while it runs
        try:
            vectors = await asyncio.to_thread(self.runner.engine.embed, inputs, request.dimensions)
        finally:
            self.runner.model.release_call(call)
        tokens = sum(len(ids) for ids in inputs)
        metrics.TOKENS.labels(**labels, direction="input").inc(tokens)
        metrics.REQUEST_DURATION.labels(**labels, status="OK").observe(time.perf_counter() - began)
        log.info("embedded", inputs=len(inputs), tokens=tokens, ms=round((time.perf_counter() - began) * 1000, 2))
        return worker_pb2.WorkerEmbedResponse(
            embeddings=[inference_pb2.Embedding(values=v) for v in vectors], prompt_tokens=tokens
        )

    async def Generate(
        self,
        request_iterator: AsyncIterator[worker_pb2.WorkerRequest],
        context: grpc.aio.ServicerContext | None = None,
    ) -> AsyncIterator[worker_pb2.WorkerResponse]:
        """One stream's turns: a gRPC call's, or (no ``context``: it uses none) a stream of the stream
        transport's. Failures are domain errors, mapped to the call's or the stream's status."""
        stream = _Stream(session=self.runner.sessions.open())
        reader = asyncio.create_task(self._read(request_iterator, stream))
        try:
            while (start := await stream.starts.get()) is not None or stream.overflow:
                if stream.overflow:
                    raise ResourceExhausted(
                        f"more than {MAX_QUEUED_STARTS} turns were started ahead of the turn in progress on one stream"
                    )
                assert start is not None
                async for response in self._turn(start, stream):
                    yield response
        finally:
            reader.cancel()
            if stream.turn is not None:
                stream.turn.cancel()
            if stream.session is not None:
                stream.session.close()

    async def _read(self, request_iterator: AsyncIterator[worker_pb2.WorkerRequest], stream: _Stream) -> None:
        try:
            async for request in request_iterator:
                if request.HasField("start"):
                    if stream.starts.qsize() >= MAX_QUEUED_STARTS:
                        stream.overflow = True  # stop reading: the peer's frames wait in flow control
                        return
                    stream.starts.put_nowait(request.start)
                elif request.HasField("cancel"):
                    if stream.turn is not None:
                        stream.turn.cancel()
                    elif not stream.starts.empty():
                        stream.cancel_next = True
        except Exception as exc:  # the call ended under us (cancelled, reset): treat as closed
            log.debug("worker_stream_read_ended", error=type(exc).__name__)
        finally:
            stream.starts.put_nowait(None)

    def to_request(self, start: worker_pb2.WorkerStart) -> GenerationRequest:
        """Validate a start frame (InvalidArgument on bad input) and resolve its sampling."""
        info = self.runner.engine.info
        prompt = tuple(start.prompt_token_ids)
        resume = tuple(start.resume_token_ids)
        validate_prompt(prompt + resume, info)
        sampling = sampling_pb.from_pb(start.sampling).fit(
            len(prompt), info.context_length, self.default_max_tokens, vocab_size=info.vocab_size
        )
        if sampling.n > 1:
            most = self.runner.admission.max_active
            if sampling.n > most:
                raise InvalidArgument(
                    f"sampling.n is {sampling.n} but this worker runs at most {most} sequences at once; ask for "
                    f"at most {most} choices"
                )
            if resume:
                raise InvalidArgument(
                    "resume_token_ids cannot be sent with sampling.n > 1; resume one choice at a time"
                )
        check_sampling(self.runner.capabilities, sampling)
        return GenerationRequest(
            prompt,
            sampling,
            resume,
            start.request_id,
            start.tenant,
            start.shareable_prefix,
            start.priority,
            start.background,
        )

    async def _turn(self, start: worker_pb2.WorkerStart, stream: _Stream) -> AsyncIterator[worker_pb2.WorkerResponse]:
        began = last = time.perf_counter()
        labels = {"service": self.service, "tier": self.tier}
        turn = self.runner.turn(self.to_request(start), stream.session)
        stream.turn = turn
        if stream.cancel_next:
            stream.cancel_next = False
            turn.cancel()
        status = "CANCELLED"
        sequence = 0
        finals = turn.request.sampling.n  # one final frame per choice; the turn ends after the last
        delay = self.first_token_delay_s
        try:
            async with aclosing(turn.events()) as events:
                async for event in events:
                    if event.queued:
                        yield _QUEUED
                        continue
                    if delay:  # fault injection, off by default: the first frame comes late
                        await asyncio.sleep(delay)
                        delay = 0.0
                    now = time.perf_counter()
                    final = event.final
                    if final is not None:
                        status = "CANCELLED" if final.reason is FinishReason.CANCELLED else "OK"
                        if event.index == 0:  # the prompt of n choices is counted once
                            self._tokens_in.inc(final.prompt_tokens)
                        self._tokens_out.inc(final.completion_tokens)
                        yield worker_pb2.WorkerResponse(
                            sequence=sequence, text=event.text, final=_final(final), index=event.index
                        )
                        sequence += 1
                        finals -= 1
                        if finals == 0:
                            break
                        continue
                    if sequence == 0:
                        self._ttft.observe(now - began)
                    else:
                        self._inter_token.observe(now - last)
                    last = now
                    frame = worker_pb2.WorkerResponse(
                        sequence=sequence, token_ids=event.token_ids, text=event.text, index=event.index
                    )
                    if event.logprobs:
                        frame.logprobs.extend(logprobs_pb.to_pb(event.logprobs))
                    yield frame
                    sequence += 1
        except MeshError as exc:
            status = exc.code
            raise
        except Exception:
            status = "INTERNAL"
            raise
        finally:
            stream.turn = None
            metrics.REQUEST_DURATION.labels(**labels, status=status).observe(time.perf_counter() - began)


_QUEUED = worker_pb2.WorkerResponse(queued=True)


def _state_reply(t: Transition) -> worker_pb2.ModelStateReply:
    return worker_pb2.ModelStateReply(
        model_state=model_state_pb.to_pb(t.state),
        seconds=t.seconds,
        resident_bytes=t.resident_bytes,
    )


def _final(final: Final) -> worker_pb2.WorkerFinal:
    return worker_pb2.WorkerFinal(
        finish_reason=int(final.reason),  # type: ignore[arg-type]  # the enum's numbers are the pb's
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        prefill_tokens=final.prefill_tokens,
        budget_closed=final.budget_closed,
    )
