"""Next-token choice from one row of logits: greedy, or temperature / top-k / top-p with a seeded RNG.

numpy on the engine loop thread, in the step; each sequence owns its ``numpy.random.Generator``, so a seed gives
the same tokens however many sequences share a decode step. A sequence's penalties, ``logit_bias`` and
``min_tokens`` (:mod:`services.worker.penalties`) adjust its own row first, then its structured-output
constraint (:mod:`services.worker.grammar`) masks the row to the tokens its grammar allows, so one row's
adjustments never touch another's. :func:`logprobs` reads the row after the penalties, before the mask
(only for a sequence that asked for logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.logprobs import SampledLogprobs
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


def logprobs(logits: np.ndarray, token: int, top: int) -> SampledLogprobs:
    """``token``'s log-softmax over one row of logits ``[vocab]`` and its ``top`` most likely tokens: one
    row of :func:`logprobs_rows` (``logits`` is not modified)."""
    return logprobs_rows(np.array(logits[None, :], dtype=np.float32), [token], [top])[0]


def logprobs_rows(rows: np.ndarray, tokens: Sequence[int], tops: Sequence[int]) -> list[SampledLogprobs]:
    """For each row ``i`` of ``rows`` ``[m, vocab]`` (float32 scratch: overwritten), the log-softmax at
    ``tokens[i]`` and the ``tops[i]`` most likely tokens, most likely first (equal logits by id).

    The rows are the ones their tokens were drawn from (penalties applied). Whole-batch numpy: two passes
    over the rows (the shift by each row's maximum, exp in place; float32, numpy's pairwise sum) and
    max(``tops``) argmax passes, each masking the one before (cheaper than an ``argpartition`` for k <= 20).
    The step runs it once for the rows that ask (per-row calls from each sequence's own thread, when
    sequences had threads, measured slower: 16 threads contending for the GIL with the batch thread).
    """
    m = rows.shape[0]
    at = np.arange(m)
    np.subtract(rows, rows.max(axis=1, keepdims=True), out=rows)
    chosen = rows[at, np.asarray(tokens)].astype(np.float64)
    k = min(max(tops, default=0), rows.shape[1])
    best = np.empty((m, k), dtype=np.int64)
    values = np.empty((m, k), dtype=np.float32)
    for j in range(k):
        best[:, j] = rows.argmax(axis=1)
        values[:, j] = rows[at, best[:, j]]
        rows[at, best[:, j]] = -np.inf
    if k:
        rows[at[:, None], best] = values
    lse = np.log(np.exp(rows, out=rows).sum(axis=1)).astype(np.float64)
    out = []
    for i in range(m):
        top = tops[i]
        out.append(
            SampledLogprobs(
                int(tokens[i]),
                float(chosen[i] - lse[i]),
                best[i, :top].tolist(),
                (values[i, :top].astype(np.float64) - lse[i]).tolist(),
            )
        )
    return out
