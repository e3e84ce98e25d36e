"""The cloud engine with speculative decoding for greedy requests (``MESHSERVE_GPU_WORKER_SPECULATIVE``).

:class:`SpeculativeEngine` wraps a :class:`CloudEngine` and changes only ``start``: a greedy,
non-resumed request becomes a :class:`SpeculativeSequence` (speculative.py), everything else (sampled
requests, resumed streams, and greedy ones when the KV budget has no room for them right now) goes
to the engine's continuous-batching scheduler unchanged. Every other attribute (info, tokenizer,
kv_usage, hot_prefix_blocks, close, ...) is the wrapped engine's.

A speculative sequence takes its KV blocks from the engine's block manager (so KV accounting and the
budget cover it) and runs its prefill and verify passes through the scheduler's ``forward`` — the
same function the batch steps use, so under tensor parallelism they are mirrored on the follower
ranks and serialized with the batch steps. They run on the sequence's own thread, next to (not
inside) the batch: on CPU a verify pass of k+1 tokens costs about what a batch step of k+1
sequences does, and latency for a single stream is what speculation is for. It does not use the
prefix cache (it prefills its whole prompt), in chunks of the scheduler's step budget
(``max_step_tokens``, whole blocks), so a cancel reaches it after one chunk (``interrupt()``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from services.common.sampling import SamplingParams
from services.gpu_worker.engine import CloudEngine, CloudSequence
from services.gpu_worker.speculative import SpeculativeDecoder, draft_factory, greedy_only
from services.worker.types import StepInterrupted


class SpeculativeSequence:
    """One greedy generation by draft-and-verify rounds (falls back to the scheduler if KV is short)."""

    def __init__(self, spec: SpeculativeEngine, token_ids: Sequence[int], sampling: SamplingParams) -> None:
        self._spec = spec
        self._token_ids = list(token_ids)
        self._sampling = sampling
        self._decoder: SpeculativeDecoder | None = None
        self._fallback: CloudSequence | None = None
        self._blocks: list[int] = []
        self._closed = False
        self._interrupted = False
        self.prefill_tokens = len(self._token_ids)

    def interrupt(self) -> None:
        """End the pending (or next) step with StepInterrupted after the model call in flight (one
        prefill chunk at most). Any thread; waits for nothing."""
        self._interrupted = True
        if self._decoder is not None:
            self._decoder.interrupt()
        if self._fallback is not None:
            self._fallback.interrupt()

    def _begin(self) -> None:
        engine = self._spec.engine
        bt = engine.block_tokens
        need = -(-(len(self._token_ids) + self._sampling.max_tokens + self._spec.k_max + 1) // bt)
        with engine.scheduler.cond:
            blocks = engine.blocks.allocate(need)
        if blocks is None:  # no room now: the scheduler queues it until there is
            self._fallback = CloudSequence(engine, self._token_ids, self._sampling, ())
            return
        self._blocks = blocks
        max_length = len(self._token_ids) + self._sampling.max_tokens + self._spec.k_max + 2
        self._decoder = SpeculativeDecoder(
            engine.scheduler.forward,
            blocks,
            self._token_ids,
            max(1, self._sampling.max_tokens),
            draft_factory(self._spec.draft_model, max_length),
            k_max=self._spec.k_max,
            eos=engine.info.eos_token_ids,
            prefill_chunk=max(bt, engine.scheduler.max_step_tokens // bt * bt),
            on_prefill_chunk=self._spec.count_prefill_chunk,
        )

    def step(self) -> int:
        if self._closed:
            raise RuntimeError("sequence is closed")
        if self._decoder is None and self._fallback is None:
            if self._interrupted:
                raise StepInterrupted("the turn was cancelled")
            self._begin()
            if self._interrupted:  # interrupted while it was beginning: pass it on
                self.interrupt()
        if self._fallback is not None:
            token = self._fallback.step()
            self.prefill_tokens = self._fallback.prefill_tokens
            return token
        assert self._decoder is not None
        return self._decoder.next()

    @property
    def stats(self) -> tuple[int, int]:
        """(drafted, accepted) tokens so far."""
        d = self._decoder
        return (d.drafted, d.accepted) if d is not None else (0, 0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._fallback is not None:
            self._fallback.close()
        if self._decoder is not None:
            self._decoder.close()
        if self._blocks:
            engine = self._spec.engine
            with engine.scheduler.cond:
                engine.blocks.release(self._blocks)
                self._blocks = []
                engine.scheduler.cond.notify_all()  # waiting admissions may fit now


class SpeculativeEngine:
    """A :class:`CloudEngine` whose greedy requests decode speculatively (see the module docstring)."""

    def __init__(self, engine: CloudEngine, draft_model: Any, *, k_max: int = 8) -> None:
        self.engine = engine
        self.draft_model = draft_model
        self.k_max = k_max
        self.prefill_chunks = 0
        """Prefill forwards of speculative sequences so far (their prompts go in chunks)."""
        self._lock = threading.Lock()

    def count_prefill_chunk(self) -> None:
        with self._lock:
            self.prefill_chunks += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["engine"], name)

    def start(
        self, token_ids: Sequence[int], sampling: SamplingParams, replay: Sequence[int] = ()
    ) -> SpeculativeSequence | CloudSequence:
        if greedy_only(sampling) and not replay and not sampling.logprobs:  # logprobs: the scheduler computes them
            return SpeculativeSequence(self, token_ids, sampling)
        return self.engine.start(token_ids, sampling, replay)
