"""Per-sequence token choice from a logits row: greedy, or temperature / top-k / top-p sampling.

Uses transformers' own logits warpers in ``generate``'s order and a per-sequence
``torch.Generator``, so a seed reproduces its tokens whatever else shares the batch. The sequence's
penalties, ``logit_bias`` and ``min_tokens`` (:mod:`services.worker.penalties`) adjust its row first,
then its structured-output constraint (:mod:`services.worker.grammar`) masks it; the device sampler
applies the same numbers from :attr:`Sampler.penalties` and the same mask from :attr:`Sampler.constraint`.
A sequence that asks for logprobs gets them from the row after the penalties, before the mask
(:attr:`Sampler.last_logprobs`), on the row's device.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams
from services.gpu_worker.device_sampler import RowSampling, tokens_and_logprobs
from services.worker.grammar import TokenConstraint
from services.worker.penalties import Penalties, penalties_for

if TYPE_CHECKING:
    from transformers.generation.logits_process import LogitsProcessorList

_NO_IDS = cast(torch.LongTensor, torch.zeros(1, 1, dtype=torch.long))


class Sampler:
    """Chooses one sequence's tokens (not thread-safe; the engine loop thread calls it)."""

    def __init__(
        self,
        sampling: SamplingParams,
        prompt_ids: Iterable[int] = (),
        eos_ids: Iterable[int] = (),
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.greedy = sampling.greedy
        self.penalties: Penalties | None = penalties_for(sampling, prompt_ids, eos_ids)
        """The sequence's penalties (None: none asked for); :meth:`record` keeps them current."""
        self.constraint = constraint
        """The sequence's structured-output grammar state (None: unconstrained); :meth:`record` advances it."""
        self.row = RowSampling.from_config(sampling)
        """The same parameters for the device sampler (engines running static decode steps use it)."""
        self.top: int | None = sampling.top_logprobs if sampling.logprobs else None
        """Alternatives per token for its logprobs (None: it asked for no logprobs)."""
        self.last_logprobs: SampledLogprobs | None = None
        """The logprobs of the token :meth:`pick` chose last (when ``top`` is not None)."""
        self._warpers: LogitsProcessorList | None = None
        self._rng: torch.Generator | None = None
        if not self.greedy:
            # Imported on first use (the engine imports it on its I/O thread before it makes the first
            # sampled sequence): ~1 s of CPU a restarting worker need not pay before it serves
            # (docs/cloud.md, *Startup*), and that the engine loop never waits for.
            from transformers.generation.logits_process import (
                LogitsProcessorList,
                TemperatureLogitsWarper,
                TopKLogitsWarper,
                TopPLogitsWarper,
            )

            self._warpers = LogitsProcessorList()
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

    def record(self, token: int) -> None:
        """``token`` was generated: the penalties count it and the grammar advances over it, whichever
        sampler chose it."""
        if self.penalties is not None:
            self.penalties.record(token)
        if self.constraint is not None:
            self.constraint.advance(token)

    def replayed(self, token: int) -> None:
        """A resumed stream's ``token`` was fed back: the penalties count it (the grammar state came
        already advanced over the replay, ``NewSequence.constraint``)."""
        if self.penalties is not None:
            self.penalties.record(token)

    def mask(self) -> np.ndarray | None:
        """The allowed next tokens as a bitmask for the device sampler (None: unconstrained)."""
        return None if self.constraint is None else self.constraint.bitmask()

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from a ``[1, vocab]`` float32 logits row (the caller then calls :meth:`record`)."""
        if self.penalties is not None:
            logits = apply_penalties(logits, self.penalties)
        adjusted = logits  # what the logprobs are of: penalties applied, before the grammar's mask
        if self.constraint is not None:
            allowed = torch.from_numpy(self.constraint.allowed()).to(logits.device)
            logits = logits.masked_fill(~allowed[None, : logits.shape[-1]], float("-inf"))
        if self.greedy:
            token = int(torch.argmax(logits, dim=-1).item())
        else:
            assert self._warpers is not None
            scores = self._warpers(_NO_IDS, logits.cpu())
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, num_samples=1, generator=self._rng).item())
        if self.top is not None:
            chosen = torch.tensor([token], dtype=torch.int64, device=logits.device)
            self.last_logprobs = tokens_and_logprobs(chosen, adjusted, [self.top])[1][0]
        return token


def warpers_imported() -> bool:
    """Whether a sampled ``Sampler`` can be made without importing transformers first (~1 s of CPU)."""
    return "transformers.generation.logits_process" in sys.modules


def import_warpers() -> None:
    """Import what sampled sequences use (see ``Sampler``); blocking."""
    import transformers.generation.logits_process  # noqa: F401


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """``[1, vocab]`` logits adjusted by one sequence's penalties (a new tensor, on the same device)."""
    out = logits.to(torch.float32).clone()
    device = out.device
    if penalties.bias_ids.size:
        ids = torch.from_numpy(penalties.bias_ids).to(device)
        out[0, ids] += torch.from_numpy(penalties.bias_values).to(device)
    seen = penalties.seen_ids
    if seen.size:
        ids = torch.from_numpy(seen.copy()).to(device)
        if penalties.repetition != 1.0:
            row = out[0, ids]
            out[0, ids] = torch.where(row > 0, row / penalties.repetition, row * penalties.repetition)
        if penalties.frequency != 0.0 or penalties.presence != 0.0:
            out[0, ids] += torch.from_numpy(penalties.post_values()).to(device)
    if penalties.eos_banned:
        out[0, torch.from_numpy(penalties.eos_ids).to(device)] = float("-inf")
    return out
