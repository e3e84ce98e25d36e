"""Next-token choice from one row of logits: greedy, or temperature / top-k / top-p with a seeded RNG.

numpy on the engine's batch thread; each sequence owns its ``numpy.random.Generator``, so a seed gives
the same tokens however many sequences share a decode step. A sequence's penalties, ``logit_bias`` and
``min_tokens`` (:mod:`services.worker.penalties`) adjust its own row first, so one row's never touch
another's. :func:`logprobs` reads that adjusted row (only for a sequence that asked for logprobs).
"""

from __future__ import annotations

import numpy as np

from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams
from services.worker.penalties import Penalties


def rng_for(sampling: SamplingParams) -> np.random.Generator | None:
    """The sequence's random generator (None for greedy decoding)."""
    if sampling.greedy:
        return None
    return np.random.default_rng(sampling.seed)


def pick(
    logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator | None, penalties: Penalties | None = None
) -> int:
    """The next token id for one row of logits ``[vocab]`` (adjusted in place by ``penalties`` first:
    the row is the step's output, read once; the caller records the chosen token in them)."""
    if penalties is not None:
        logits = penalties.apply(logits, in_place=True)
    if rng is None or sampling.greedy:
        return int(np.argmax(logits))
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


def logprobs(logits: np.ndarray, token: int, top: int, *, in_place: bool = False) -> SampledLogprobs:
    """``token``'s log-softmax over one row of logits ``[vocab]`` (the row :func:`pick` chose from, its
    penalties applied) and the ``top`` most likely tokens, most likely first (equal logits by id).

    Two passes over the row (the shift by its maximum, then exp in place; float32, numpy's pairwise
    sum) and ``top`` argmax passes, each masking the one before (measured here: some 30 us for 5 and
    100 us for 20 over a 49k row, against 180 us for one ``argpartition``). Paid only by rows that ask.
    ``in_place``: ``logits`` is a float32 scratch row the caller no longer needs (no allocation: a fresh
    200 KB array per token is a fresh mapping of pages).
    """
    if in_place and logits.dtype == np.float32 and logits.flags.writeable:
        shifted = np.subtract(logits, logits.max(), out=logits)
    else:
        row = logits.astype(np.float32, copy=False)
        shifted = row - row.max()
    best: list[int] = []
    values: list[float] = []
    for _ in range(min(top, shifted.size)):
        i = int(shifted.argmax())
        best.append(i)
        values.append(float(shifted[i]))
        shifted[i] = -np.inf
    if best:
        shifted[best] = values
    chosen = float(shifted[token])
    lse = float(np.log(np.exp(shifted, out=shifted).sum()))
    return SampledLogprobs(token, chosen - lse, best, [v - lse for v in values])
