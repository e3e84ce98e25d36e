"""Per-sequence token choice from a logits row: greedy, or temperature / top-k / top-p sampling.

Uses transformers' own logits warpers in ``generate``'s order and a per-sequence
``torch.Generator``, so a seed reproduces its tokens whatever else shares the batch.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.common.sampling import SamplingParams
from services.gpu_worker.device_sampler import RowSampling

_NO_IDS = cast(torch.LongTensor, torch.zeros(1, 1, dtype=torch.long))


class Sampler:
    """Chooses one sequence's tokens (not thread-safe; the scheduler thread calls it)."""

    def __init__(self, sampling: SamplingParams) -> None:
        self.greedy = sampling.greedy
        self.row = RowSampling.from_config(sampling)
        """The same parameters for the device sampler (engines running static decode steps use it)."""
        self._warpers = LogitsProcessorList()
        self._rng: torch.Generator | None = None
        if not self.greedy:
            if sampling.temperature != 1.0:
                self._warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                self._warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                self._warpers.append(TopPLogitsWarper(sampling.top_p))
            self._rng = torch.Generator()
            if sampling.seed is not None:
                self._rng.manual_seed(sampling.seed & 0xFFFF_FFFF_FFFF_FFFF)
            else:
                self._rng.seed()

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from a ``[1, vocab]`` float32 logits row."""
        if self.greedy:
            return int(torch.argmax(logits, dim=-1).item())
        scores = self._warpers(_NO_IDS, logits.cpu())
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=self._rng).item())
