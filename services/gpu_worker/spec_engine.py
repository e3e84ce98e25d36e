"""The cloud engine with speculative decoding for greedy requests (``MESHSERVE_GPU_WORKER_SPECULATIVE``).

:class:`SpeculativeEngine` wraps a :class:`CloudEngine` and changes only which sequences it steps
itself: a greedy, non-resumed request without logprobs becomes a speculative sequence
(:class:`~services.gpu_worker.speculative.SpeculativeDecoder`); everything else (sampled requests,
resumed streams, choices of n, and greedy ones when the KV budget has no room for them right now)
goes to the engine's continuous-batching scheduler unchanged. Everything else (info, tokenizer,
kv_usage, hot_prefix_blocks, the KV transfers, close) is the wrapped engine's.

A speculative sequence takes its KV blocks from the engine's block manager (so KV accounting and the
budget cover it) and runs its prefill and verify passes through the scheduler's ``forward`` — the
same function the batch steps use, so under tensor parallelism they are mirrored on the follower
ranks. Each step of the engine loop runs the batch's packed step, then one unit of each speculative
sequence (a prefill chunk, or a draft-and-verify round): on CPU a verify pass of k+1 tokens costs
about what a batch step of k+1 sequences does, and latency for a single stream is what speculation
is for. It does not use the prefix cache (it prefills its whole prompt), in chunks of the
scheduler's step budget (``max_step_tokens``, whole blocks), so a stop reaches it after one chunk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from services.common.generation import FinishReason
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.speculative import SpeculativeDecoder, draft_factory, greedy_only
from services.worker.kv_transfer import KVExport, KVImport, KVPrefix
from services.worker.types import (
    Engine,
    EngineCapabilities,
    EngineInfo,
    KVUsage,
    NewSequence,
    SequenceOutput,
    Tokenizer,
)


class SpeculativeEngine(Engine):
    """A :class:`CloudEngine` whose greedy requests decode speculatively (see the module docstring)."""

    def __init__(self, engine: CloudEngine, draft_model: Any, *, k_max: int = 8) -> None:
        self.engine = engine
        self.draft_model = draft_model
        self.k_max = k_max
        self.prefill_chunks = 0
        """Prefill forwards of speculative sequences so far (their prompts go in chunks)."""
        self._lock = threading.Lock()
        self._live: dict[int, tuple[SpeculativeDecoder, list[int], NewSequence]] = {}
        """Speculative sequences by id: their decoder, KV blocks and how they were added."""

    def __getattr__(self, name: str) -> Any:  # the wrapped engine's attributes (scheduler, blocks, ...)
        return getattr(self.__dict__["engine"], name)

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def capabilities(self) -> EngineCapabilities:
        return self.engine.capabilities

    def count_prefill_chunk(self) -> None:
        with self._lock:
            self.prefill_chunks += 1

    def bind(self, wake: Callable[[], None]) -> None:
        self.engine.bind(wake)

    def add(self, spec: NewSequence) -> None:
        sampling = spec.sampling
        if spec.fork_of is not None and spec.fork_of in self._live:
            self._unspeculate(spec.fork_of)  # choice 0 of n: the scheduler's forks share its prefill
        if not greedy_only(sampling) or spec.replay or sampling.logprobs or spec.fork_of is not None:
            self.engine.add(spec)  # logprobs: the scheduler computes them
            return
        engine = self.engine
        bt = engine.block_tokens
        need = -(-(len(spec.prompt_ids) + sampling.max_tokens + self.k_max + 1) // bt)
        with engine.blocks.lock:
            blocks = engine.blocks.allocate(need)
        if blocks is None:  # no room now: the scheduler queues it until there is
            self.engine.add(spec)
            return
        max_length = len(spec.prompt_ids) + sampling.max_tokens + self.k_max + 2
        decoder = SpeculativeDecoder(
            engine.scheduler.forward,
            blocks,
            spec.prompt_ids,
            max(1, sampling.max_tokens),
            draft_factory(self.draft_model, max_length),
            k_max=self.k_max,
            eos=engine.info.eos_token_ids,
            prefill_chunk=max(bt, engine.scheduler.max_step_tokens // bt * bt),
            on_prefill_chunk=self.count_prefill_chunk,
        )
        self._live[spec.id] = (decoder, blocks, spec)

    def _unspeculate(self, seq_id: int) -> None:
        """Hand speculative sequence ``seq_id``, not stepped yet, to the scheduler (another choice forks
        it: the runtime adds a turn's n choices together, the first without ``fork_of``)."""
        decoder, blocks, spec = self._live[seq_id]
        if decoder.started:
            raise RuntimeError(f"sequence {seq_id} is decoding speculatively and cannot be forked")
        del self._live[seq_id]
        engine = self.engine
        with engine.blocks.lock:
            engine.blocks.release(blocks)
        engine.add(spec)

    def stop(self, seq_id: int, hold: bool = False) -> None:
        entry = self._live.pop(seq_id, None)
        if entry is None:
            self.engine.stop(seq_id, hold)
            return
        decoder, blocks, _ = entry
        decoder.close()
        engine = self.engine
        with engine.blocks.lock:
            engine.blocks.release(blocks)

    def next_step_in(self) -> float | None:
        return 0.0 if self._live else self.engine.next_step_in()

    def step(self) -> list[SequenceOutput]:
        outputs = self.engine.step() if self.engine.next_step_in() == 0 else []
        for seq_id, (decoder, _, _) in list(self._live.items()):
            first = decoder.generated == 0
            try:
                tokens = decoder.advance()
            except Exception as exc:  # that sequence fails, the others go on
                self.stop(seq_id)
                outputs.append(SequenceOutput(seq_id, error=exc))
                continue
            if not tokens:
                continue  # a prefill chunk
            out = SequenceOutput(seq_id, tokens, prefill_tokens=len(decoder.tokens) - len(tokens) if first else None)
            if decoder.finished:
                out.finish = FinishReason.STOP if tokens[-1] in decoder.eos else FinishReason.LENGTH
                self.stop(seq_id)
            outputs.append(out)
        return outputs

    def stats(self, seq_id: int) -> tuple[int, int]:
        """(drafted, accepted) tokens so far of a live speculative sequence."""
        decoder = self._live[seq_id][0]
        return decoder.drafted, decoder.accepted

    def hold_background(self, until: float) -> None:
        self.engine.hold_background(until)

    def interrupt_background(self) -> None:
        self.engine.interrupt_background()

    def kv_usage(self) -> KVUsage | None:
        return self.engine.kv_usage()

    def hot_prefix_blocks(self, block_tokens: int) -> Sequence[bytes]:
        return self.engine.hot_prefix_blocks(block_tokens)

    def import_kv(self, prefix: KVPrefix) -> KVImport:
        return self.engine.import_kv(prefix)

    def export_kv(self, prefix: KVPrefix) -> KVExport:
        return self.engine.export_kv(prefix)

    def embed(self, inputs: Sequence[Sequence[int]], dimensions: int = 0) -> list[list[float]]:
        return self.engine.embed(inputs, dimensions)

    def close(self) -> None:
        self.engine.close()
