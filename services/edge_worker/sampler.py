"""Next-token choice from one row of logits: greedy, or temperature / top-k / top-p with a seeded RNG.

numpy on the engine's batch thread; each sequence owns its ``numpy.random.Generator``, so a seed gives
the same tokens however many sequences share a decode step. A sequence's penalties, ``logit_bias`` and
``min_tokens`` (:mod:`services.worker.penalties`) adjust its own row first, then its structured-output
constraint (:mod:`services.worker.grammar`) masks the row to the tokens its grammar allows, so one row's
adjustments never touch another's.
"""

from __future__ import annotations

import numpy as np

from services.common.sampling import SamplingParams
from services.worker.grammar import TokenConstraint
from services.worker.penalties import Penalties


def rng_for(sampling: SamplingParams) -> np.random.Generator | None:
    """The sequence's random generator (None for greedy decoding)."""
    if sampling.greedy:
        return None
    return np.random.default_rng(sampling.seed)


def pick(
    logits: np.ndarray,
    sampling: SamplingParams,
    rng: np.random.Generator | None,
    penalties: Penalties | None = None,
    constraint: TokenConstraint | None = None,
) -> int:
    """The next token id for one row of logits ``[vocab]`` (adjusted in place by ``penalties``, then
    masked by ``constraint``: the row is the step's output, read once; the caller records the chosen
    token in both)."""
    if penalties is not None:
        logits = penalties.apply(logits, in_place=True)
    if constraint is not None:
        if not logits.flags.writeable:
            logits = np.array(logits, copy=True)
        logits = constraint.apply(logits)
    if rng is None or sampling.greedy:
        token = int(np.argmax(logits))
        if constraint is not None and logits[token] == -np.inf:
            return constraint.first_allowed()
        return token
    if constraint is not None and logits.max() == -np.inf:
        return constraint.first_allowed()
    scaled = logits.astype(np.float64) / sampling.temperature
    candidates = np.arange(scaled.size)
    if 0 < sampling.top_k < scaled.size:
        candidates = np.argpartition(-scaled, sampling.top_k - 1)[: sampling.top_k]
    if sampling.top_p < 1.0:
        candidates = candidates[np.argsort(-scaled[candidates], kind="stable")]
    weights = np.exp(scaled[candidates] - scaled[candidates].max())
    probs = weights / weights.sum()
    if sampling.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), sampling.top_p)) + 1
        candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
    return int(candidates[rng.choice(candidates.size, p=probs)])
