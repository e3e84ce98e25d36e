"""Static-shape decode steps: batch-size buckets, fixed-width block tables, CUDA graphs on a GPU.

Why: an eager decode step of our Llama forward issues ~1,200 small kernels from Python; on a GPU the
launches, not the math, set the step time (docs/benchmarks/cloud_gpu.md). A pure decode step (every
segment one token, no prefill chunk, no verify run) is instead run with shapes that depend only on
two bucketed numbers, so each (batch bucket, table width) pair is captured once as a CUDA graph and
replayed (the recipe of vLLM's FULL_DECODE_ONLY, nano-vllm and SGLang):

* Batch buckets ``1, 2, 4, 8``, then every 8 up to 64, then every 16 up to ``max_batch``. A step of
  ``n`` sequences runs the smallest bucket ``>= n``; rows ``n..bucket-1`` are padding: token 0 at
  position 0, context length 1, every block-table entry the *pad block*, and their K/V written to
  a slot of the pad block. The pad block is one KV block the engine keeps out of its block manager
  (taken from the KV budget), so padding never touches a sequence's KV.
* Table widths: the step attends over ``W`` blocks per row, ``W`` the smallest power of two (at
  least ``MIN_WIDTH``) covering the longest context in the batch, capped at the longest context a
  sequence can have. Attention is SDPA over the K/V gathered through the block table and masked
  by the context lengths (model.py ``decode_fixed``): the only attention here that runs on CPU and
  GPU alike with fixed shapes. The gather costs ``B * W * block_tokens`` K/V reads per layer, so
  the width bucket keeps it near the real context.
* Static buffers are allocated once at the largest bucket and widest table: token ids, positions,
  slots, context lengths, block tables ``[max_batch, max_width]``, the sampling parameters
  (device_sampler.py) and the chosen token ids. A step fills them (one host-to-device copy each),
  runs the step for a ``[:bucket]`` / ``[:bucket, :width]`` slice, and copies the ``[:n]`` chosen ids
  to the host once (``.tolist()``). Sampling happens on the device inside the step. Rows that ask for
  logprobs get them after the step, outside the graph, from the step's logits (a static tensor of
  the graph's pool), on the device, fetched in that same one copy (device_sampler.py
  ``tokens_and_logprobs``): a graph stays the same whether or not a row asks.
* On CUDA each (bucket, width, sampled, penalized) step is captured as a ``torch.cuda.CUDAGraph`` the first
  time that width is needed, every bucket at once, largest first, into one shared memory pool,
  after one eager warm-up run per shape on a side stream (so nothing allocates or synchronises
  lazily during capture). ``sampled`` is whether any row samples: all-greedy batches replay a graph
  that only takes the argmax; ``penalized`` is whether any row has penalties, ``logit_bias`` or
  ``min_tokens`` (their buffers are read only then). On CPU the same fixed-shape step runs eagerly (no capture): that is
  what CI tests against the eager path token for token.

Prefill chunks, mixed steps and speculative verify runs stay on the eager path (model.py
``forward``), which is also the CPU path when static decode is off.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch
from torch import Tensor

from services.common.logprobs import SampledLogprobs
from services.gpu_worker.device_sampler import RowSampling, SamplingBuffers, tokens_and_logprobs
from services.gpu_worker.model import KVCache, LlamaModel
from services.gpu_worker.plan import Segment
from services.worker.penalties import Penalties

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = structlog.get_logger(__name__)

MIN_WIDTH = 8
"""Narrowest block table a step attends over (blocks): fewer, smaller graphs for short contexts."""


def batch_buckets(max_batch: int) -> list[int]:
    """``1, 2, 4, 8, 16, ..., 64`` (every 8), then every 16, always ending at ``max_batch``."""
    out = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        out.append(b)
        b += 8 if b < 64 else 16
    out.append(max_batch)
    return out


def width_buckets(max_width: int) -> list[int]:
    """Powers of two from ``MIN_WIDTH`` (blocks), always ending at ``max_width``."""
    out: list[int] = []
    w = MIN_WIDTH
    while w < max_width:
        out.append(w)
        w *= 2
    out.append(max_width)
    return out


def _ceil(values: list[int], n: int) -> int:
    return next(v for v in values if v >= n)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    out: Tensor
    logits: Tensor
    """The step's logits (before penalties), as the graph leaves them after each replay."""


class StaticDecoder:
    """Runs pure decode steps with fixed shapes (see the module docstring). Scheduler thread only."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        *,
        max_batch: int,
        pad_block: int,
        max_context: int,
        capture: bool,
    ) -> None:
        device = model.device
        bt = cache.block_tokens
        self.model = model
        self.cache = cache
        self.max_batch = max_batch
        self.pad_block = pad_block
        self.pad_slot = pad_block * bt
        self.buckets = batch_buckets(max_batch)
        self.widths = width_buckets(max(1, -(-max_context // bt)))
        self.capture = capture and device.type == "cuda"
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slots = torch.full((max_batch,), self.pad_slot, dtype=torch.int64, device=device)
        self.lengths = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.tables = torch.full((max_batch, self.widths[-1]), pad_block, dtype=torch.int64, device=device)
        self.sampling = SamplingBuffers(max_batch, device)
        self.out = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._logits: Tensor | None = None  # the last eager ``_run``'s (or capture's) logits
        self._graphs: dict[tuple[int, int, bool, bool, bool], _Graph] = {}
        self._pool: _POOL_HANDLE | None = None
        self.graph_bytes = 0
        """Device memory the captured graphs' pool holds (CUDA; measured around each capture)."""
        self.steps = 0
        self.replays = 0

    def fits(self, segments: Sequence[Segment]) -> bool:
        """Whether a step of these segments runs here: pure decode, within the buckets and widths."""
        if not segments or len(segments) > self.max_batch:
            return False
        bt = self.cache.block_tokens
        for seg in segments:
            if len(seg.token_ids) != 1 or seg.all_logits or (seg.start + bt) // bt > self.widths[-1]:
                return False
        return True

    def step(
        self,
        segments: Sequence[Segment],
        rows: Sequence[RowSampling],
        steps: Sequence[int],
        penalties: Sequence[Penalties | None] = (),
        masks: Sequence[np.ndarray | None] = (),
    ) -> list[int]:
        """The next token of each segment (one device-to-host copy). ``rows``/``steps``/``penalties``/``masks``:
        each segment's sampling parameters, how many tokens its sequence has generated (the noise
        counter), its penalties and its structured-output bitmask (None, or an empty sequence: none)."""
        return self.step_with_logprobs(segments, rows, steps, penalties, masks=masks)[0]

    def step_with_logprobs(
        self,
        segments: Sequence[Segment],
        rows: Sequence[RowSampling],
        steps: Sequence[int],
        penalties: Sequence[Penalties | None] = (),
        tops: Sequence[int | None] = (),
        masks: Sequence[np.ndarray | None] = (),
    ) -> tuple[list[int], list[SampledLogprobs | None]]:
        """:meth:`step`, plus the logprobs of the segments whose ``tops`` entry is not None (that many
        alternatives each; see the module docstring), in the same device-to-host copy. Logprobs are of
        the penalised logits, before the structured-output mask."""
        n = len(segments)
        bt = self.cache.block_tokens
        bucket = _ceil(self.buckets, n)
        width = _ceil(self.widths, max((seg.start + bt) // bt for seg in segments))
        pad = self.max_batch - n
        tokens = [int(seg.token_ids[0]) for seg in segments] + [0] * pad
        positions = [seg.start for seg in segments] + [0] * pad
        slots = [seg.block_table[seg.start // bt] * bt + seg.start % bt for seg in segments] + [self.pad_slot] * pad
        lengths = [seg.start + 1 for seg in segments] + [1] * pad
        full = self.widths[-1]
        table = [list(seg.block_table[:full]) + [self.pad_block] * (full - len(seg.block_table)) for seg in segments]
        table += [[self.pad_block] * full] * pad
        sampled = self.sampling.fill(list(rows), list(steps))
        penalized = bool(penalties) and self.sampling.fill_penalties(list(penalties), self.model.config.vocab)
        constrained = bool(masks) and self.sampling.fill_masks(masks, self.model.config.vocab)
        blocking = self.tokens.device.type != "cuda"
        for dst, values in (
            (self.tokens, tokens),
            (self.positions, positions),
            (self.slots, slots),
            (self.lengths, lengths),
            (self.tables, table),
        ):
            dst.copy_(torch.tensor(values, dtype=torch.int64), non_blocking=not blocking)
        self.steps += 1
        if self.capture:
            key = (bucket, width, sampled, penalized, constrained)
            graph = self._graphs.get(key)
            if graph is None:
                self._capture_width(width, sampled, penalized, constrained)
                graph = self._graphs[key]
            graph.graph.replay()
            self.replays += 1
            out, logits = graph.out, graph.logits
        else:
            out = self._run(bucket, width, sampled, penalized, constrained)
            assert self._logits is not None
            logits = self._logits
        if not any(top is not None for top in tops):
            return [int(t) for t in out[:n].tolist()], [None] * n
        with torch.inference_mode():
            scores = logits[:n]
            if penalized:  # the buffers still hold this step's penalties
                scores = self.sampling.penalize(scores)
            return tokens_and_logprobs(out[:n], scores, list(tops))

    @torch.inference_mode()
    def _run(
        self, bucket: int, width: int, sampled: bool, penalized: bool = False, constrained: bool = False
    ) -> Tensor:
        logits = self.model.decode_fixed(
            self.tokens[:bucket],
            self.positions[:bucket],
            self.slots[:bucket],
            self.lengths[:bucket],
            self.tables[:bucket, :width],
            self.cache,
        )
        self._logits = logits
        self.out[:bucket].copy_(
            self.sampling.sample(logits, sampled=sampled, penalized=penalized, constrained=constrained)
        )
        return self.out

    def capture_all(self, width: int | None = None, sampled: bool = False) -> None:
        """Capture every batch bucket of ``width`` (default: the narrowest) now (CUDA; no-op on CPU).

        Between steps only (the engine loop thread, or before the loop runs): the buffers are reset to
        padding first, so the warm-up and capture runs write K/V only into the pad block (the last
        step's slots may belong to another sequence by now)."""
        if self.capture:
            self.tokens.zero_()
            self.positions.zero_()
            self.slots.fill_(self.pad_slot)
            self.lengths.fill_(1)
            self.tables.fill_(self.pad_block)
            self._capture_width(width or self.widths[0], sampled)

    def _capture_width(self, width: int, sampled: bool, penalized: bool = False, constrained: bool = False) -> None:
        """Capture every batch bucket at ``width``, largest first, into the shared pool.

        The static buffers hold the current step's inputs; the warm-up and capture runs write their
        K/V to the slots those name and recompute the same values, so the cache is unchanged. The
        pad rows of the buffers stay valid padding (see the module docstring)."""
        began = time.monotonic()
        before = torch.cuda.memory_reserved(self.tokens.device)
        stream = torch.cuda.Stream(self.tokens.device)
        stream.wait_stream(torch.cuda.current_stream(self.tokens.device))
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                self._run(
                    bucket, width, sampled, penalized, constrained
                )  # warm-up: kernels chosen, workspaces allocated
        torch.cuda.current_stream(self.tokens.device).wait_stream(stream)
        torch.cuda.synchronize(self.tokens.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            # thread_local: a speculative verify pass or a KV import on another thread may use CUDA meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._run(bucket, width, sampled, penalized, constrained)
            assert self._logits is not None
            self._graphs[(bucket, width, sampled, penalized, constrained)] = _Graph(graph, out, self._logits)
        torch.cuda.synchronize(self.tokens.device)
        self.graph_bytes += torch.cuda.memory_reserved(self.tokens.device) - before
        log.info(
            "decode_graphs_captured",
            width_blocks=width,
            sampled=sampled,
            penalized=penalized,
            constrained=constrained,
            buckets=len(self.buckets),
            seconds=round(time.monotonic() - began, 2),
            graph_bytes=self.graph_bytes,
        )
