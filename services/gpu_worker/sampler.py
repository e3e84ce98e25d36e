"""A sequence's sampling state on the cloud engine: its parameters for the device sampler, its
penalties and its grammar.

Every token of the cloud engine, eager steps' and static steps' alike, is chosen by the device sampler
(:mod:`services.gpu_worker.device_sampler`: one call per step for every row, counter-based noise, so a
seed gives the same tokens whatever else shares the step, and a resumed stream draws what the
undisturbed one drew). This holds what that call reads per row: :attr:`Sampler.row` (temperature,
top-k, top-p, seed), :attr:`Sampler.penalties` (:mod:`services.worker.penalties`), the grammar's mask
(:meth:`Sampler.mask`), and how many logprobs alternatives the row wants (:attr:`Sampler.top`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from services.common.sampling import SamplingParams
from services.gpu_worker.device_sampler import RowSampling
from services.worker.grammar import TokenConstraint
from services.worker.penalties import Penalties, penalties_for


class Sampler:
    """One sequence's sampling state (not thread-safe; the engine loop thread uses it)."""

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
        """Its parameters as the device sampler takes them (the seed resolved)."""
        self.top: int | None = sampling.top_logprobs if sampling.logprobs else None
        """Alternatives per token for its logprobs (None: it asked for no logprobs)."""

    def record(self, token: int) -> None:
        """``token`` was generated: the penalties count it and the grammar advances over it."""
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
