"""Token choice for a whole batch on the model's device: greedy, temperature / top-k / top-p, per-row seeds.

Used by the static-shape decode step (graphs.py), where it runs inside the captured CUDA graph, and
by the scheduler for the eager steps of an engine that runs static decode steps, so a sequence's
tokens come from one sampler whatever kind of step produced them. One call handles every row at once
with fixed shapes and no host synchronisation; the caller copies the chosen ids to the host once.

Why our own instead of transformers' logits warpers (sampler.py uses those, per sequence, on the
host): they take one generator per call and ``multinomial`` draws from torch's stateful RNG, which a
CUDA graph replays with one seed for the batch. Here randomness is a counter-based hash (Gumbel-max):
the noise of token ``t`` for a row is ``hash(seed, step, t)``, where ``step`` is how many tokens the
turn has so far (a resumed stream's replayed ones included). No state is carried between steps, so a
seed reproduces its tokens whatever else shares the batch, whichever kind of step (static or eager)
ran and on whichever worker a resumed stream continues, and padding rows consume nothing. The
warpers' order and semantics follow ``generate``: temperature, then top-k, then top-p over the
top-k-filtered distribution (at least one token kept). Ties at the top-k boundary keep the first
``k`` in sort order (transformers keeps every tied token): a measure-zero difference for float
logits.

Penalties, ``logit_bias`` and ``min_tokens`` (services/worker/penalties.py) are three dense
``[max_rows, vocab]`` buffers the step reads in place: an addend before the repetition scaling (the
bias), the scaling divisor (``repetition_penalty`` on seen tokens, 1 elsewhere), and an addend after
it (minus the frequency and presence penalties; -inf on EOS before ``min_tokens``). ``fill`` resets
them on the device and writes only each penalised row's sparse entries (one host-to-device copy per
buffer); a row without penalties is all 0 / 1 / 0, which leaves its logits bit-identical, so one row's
penalties never change another's tokens. A batch without any penalised row skips them (its own graph).

Structured output (services/worker/grammar.py): a constrained row's allowed tokens arrive as a bitmask
(int32 words, one bit per token) in a ``[max_rows, words]`` buffer, unpacked on the device and applied
after the penalties (a disallowed token's logit becomes -inf); other rows' words are all ones, which
leaves their logits bit-identical. A batch without any constrained row skips it (its own graph).

Logprobs (:func:`tokens_and_logprobs`): for the rows that ask only, the log-softmax of the penalised
logits, the chosen token's entry and a ``topk`` are computed on the device after the step, and fetched
with the step's token ids in one device-to-host copy; a step without such rows runs as before.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams
from services.worker.penalties import Penalties

_M32 = 0xFFFF_FFFF


@dataclass(frozen=True)
class RowSampling:
    """One row's sampling parameters as the device sampler takes them (seed resolved)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int

    @classmethod
    def from_config(cls, sampling: SamplingParams) -> RowSampling:
        """``seed=None`` draws a fresh 64-bit seed (the sequence keeps it for all its steps)."""
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(64)
        return cls(
            greedy=sampling.greedy,
            temperature=sampling.temperature if sampling.temperature > 0 else 1.0,
            top_k=max(0, sampling.top_k),
            top_p=sampling.top_p if 0 < sampling.top_p <= 1 else 1.0,
            seed=seed & 0xFFFF_FFFF_FFFF_FFFF,
        )


PAD_ROW = RowSampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, seed=0)


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow (16-bit halves of ``c``)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seed_lo: Tensor, seed_hi: Tensor, step: Tensor, vocab: int) -> Tensor:
    """``[rows, vocab]`` float32 standard Gumbel noise, a pure function of (seed, step, token id)."""
    row = _hash32(seed_lo ^ _hash32(seed_hi ^ 0x9E3779B9))
    row = _hash32((row + step * 0x632BE5AB) & _M32)
    ids = torch.arange(vocab, device=seed_lo.device, dtype=torch.int64)
    h = _hash32((row[:, None] ^ _hash32(ids)[None, :]) & _M32)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # (2^24 - 0.5) / 2^24 rounds to 1.0 in float32, whose noise is +inf: a token masked to -inf then scored
    # NaN, which argmax takes (a disallowed token, 1 in 2^24 per token and step). The largest float32 below
    # 1 instead: every other value is unchanged.
    u = u.clamp(max=1.0 - 2.0**-24)
    return -torch.log(-torch.log(u))


class SamplingBuffers:
    """Per-row sampling parameters in device tensors of ``max_rows`` (static: a graph reads them in place)."""

    def __init__(self, max_rows: int, device: torch.device, vocab: int | None = None) -> None:
        self.device = device
        self.vocab = vocab
        self._pre: Tensor | None = None
        self._scale: Tensor | None = None
        self._post: Tensor | None = None
        if vocab is not None:
            self._penalty_buffers(vocab)
        self.greedy = torch.ones(max_rows, dtype=torch.bool, device=device)
        self.temperature = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.top_p = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.seed_lo = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.seed_hi = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.step = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.max_rows = max_rows
        self._bitmask: Tensor | None = None
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)

    def _penalty_buffers(self, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
        if self._pre is None or self._scale is None or self._post is None or self.vocab != vocab:
            shape = (self.max_rows, vocab)
            self.vocab = vocab
            self._pre = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self._scale = torch.ones(shape, dtype=torch.float32, device=self.device)
            self._post = torch.zeros(shape, dtype=torch.float32, device=self.device)
        return self._pre, self._scale, self._post

    def fill_penalties(self, penalties: list[Penalties | None], vocab: int) -> bool:
        """Write each row's penalties (rows without, and padding rows, neutral); returns whether any row
        has them (False: the buffers are not read, nor written)."""
        if all(p is None for p in penalties):
            return False
        pre, scale, post = self._penalty_buffers(vocab)
        pre.zero_()
        scale.fill_(1.0)
        post.zero_()
        entries: dict[str, tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]] = {
            "pre": ([], [], []),
            "scale": ([], [], []),
            "post": ([], [], []),
            "eos": ([], [], []),
        }

        def add(name: str, row: int, ids: np.ndarray, values: np.ndarray) -> None:
            if ids.size:
                rows_, cols, vals = entries[name]
                rows_.append(np.full(ids.size, row, dtype=np.int64))
                cols.append(ids)
                vals.append(values.astype(np.float32))

        for row, p in enumerate(penalties):
            if p is None:
                continue
            add("pre", row, p.bias_ids, p.bias_values)
            seen = p.seen_ids
            if p.repetition != 1.0:
                add("scale", row, seen, np.full(seen.size, p.repetition, dtype=np.float32))
            if p.frequency != 0.0 or p.presence != 0.0:
                add("post", row, seen, p.post_values())
            if p.eos_banned:
                add("eos", row, p.eos_ids, np.full(p.eos_ids.size, -np.inf, dtype=np.float32))
        for name, dst in (("pre", pre), ("scale", scale), ("post", post), ("eos", post)):
            rows_, cols, vals = entries[name]
            if rows_:  # ids are distinct within a row, so no index is written twice by one put
                index = torch.from_numpy(np.stack([np.concatenate(rows_), np.concatenate(cols)])).to(self.device)
                dst.index_put_((index[0], index[1]), torch.from_numpy(np.concatenate(vals)).to(self.device))
        return True

    def _mask_buffer(self, words: int) -> Tensor:
        if self._bitmask is None or self._bitmask.shape[1] != words:
            self._bitmask = torch.full((self.max_rows, words), -1, dtype=torch.int32, device=self.device)
        return self._bitmask

    def fill_masks(self, masks: Sequence[np.ndarray | None], vocab: int) -> bool:
        """Write each constrained row's allowed-token bitmask (other rows, and padding rows, allow every
        token); returns whether any row is constrained (False: the buffer is not read, nor written)."""
        if all(m is None for m in masks):
            return False
        words = (vocab + 31) // 32
        host = np.full((self.max_rows, words), -1, dtype=np.int32)
        for row, mask in enumerate(masks):
            if mask is not None:
                host[row] = mask[:words]
        self._mask_buffer(words).copy_(torch.from_numpy(host), non_blocking=self.device.type == "cuda")
        return True

    def constrain(self, logits: Tensor) -> Tensor:
        """``logits`` ``[rows, vocab]`` with each row's disallowed tokens (the bitmask buffer) at -inf."""
        n, vocab = logits.shape
        bitmask = self._mask_buffer((vocab + 31) // 32)[:n]
        allowed = ((bitmask[:, :, None] >> self._shifts) & 1).reshape(n, -1)[:, :vocab].bool()
        return logits.masked_fill(~allowed, float("-inf"))

    def penalize(self, logits: Tensor) -> Tensor:
        """``logits`` ``[rows, vocab]`` with the first ``rows`` rows of the penalty buffers applied."""
        n = logits.shape[0]
        pre, scale, post = self._penalty_buffers(logits.shape[-1])
        biased = logits + pre[:n]
        return torch.where(biased > 0, biased / scale[:n], biased * scale[:n]) + post[:n]

    def fill(self, rows: list[RowSampling], steps: list[int]) -> bool:
        """Write ``rows`` (then padding rows up to ``max_rows``) with one host-to-device copy per field;
        returns whether any row samples (False: every row is greedy)."""
        pad = self.max_rows - len(rows)
        if pad < 0:
            raise ValueError(f"{len(rows)} rows do not fit sampling buffers of {self.max_rows}")
        if all(r.greedy for r in rows):
            return False  # a greedy batch reads no buffer
        rows = rows + [PAD_ROW] * pad
        steps = list(steps) + [0] * pad
        self._copy(self.greedy, [r.greedy for r in rows])
        self._copy(self.temperature, [r.temperature for r in rows])
        self._copy(self.top_k, [r.top_k for r in rows])
        self._copy(self.top_p, [r.top_p for r in rows])
        self._copy(self.seed_lo, [r.seed & _M32 for r in rows])
        self._copy(self.seed_hi, [r.seed >> 32 for r in rows])
        self._copy(self.step, [s & _M32 for s in steps])
        return True

    @staticmethod
    def _copy(dst: Tensor, values: list[bool] | list[float] | list[int]) -> None:
        dst.copy_(torch.tensor(values, dtype=dst.dtype), non_blocking=dst.device.type == "cuda")

    def sample(self, logits: Tensor, *, sampled: bool, penalized: bool = False, constrained: bool = False) -> Tensor:
        """Token ids ``[rows]`` (int64, on the device) for ``logits`` ``[rows, vocab]`` float32, reading the
        first ``rows`` entries of every buffer. ``sampled=False`` skips the sampling arithmetic (greedy
        batch); ``penalized`` applies the penalty buffers first, ``constrained`` then the token masks."""
        n = logits.shape[0]
        if penalized:
            logits = self.penalize(logits)
        if constrained:
            logits = self.constrain(logits)
        best = logits.argmax(dim=-1)
        if not sampled:
            return best
        return torch.where(self.greedy[:n], best, self._draw(logits, n))

    def _draw(self, logits: Tensor, n: int) -> Tensor:
        vocab = logits.shape[-1]
        scores = logits / self.temperature[:n, None]
        ordered, order = scores.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(self.top_k[:n] > 0, self.top_k[:n], vocab)
        ordered = ordered.masked_fill(rank >= k[:, None], float("-inf"))
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        ordered = ordered.masked_fill((before >= self.top_p[:n, None]) & (rank > 0), float("-inf"))
        noise = gumbel_noise(self.seed_lo[:n], self.seed_hi[:n], self.step[:n], vocab).gather(-1, order)
        choice = (ordered + noise).argmax(dim=-1, keepdim=True)
        return order.gather(-1, choice).squeeze(-1)


def sample_rows(
    logits: Tensor,
    rows: list[RowSampling],
    steps: list[int],
    penalties: list[Penalties | None] | None = None,
    masks: Sequence[np.ndarray | None] = (),
) -> list[int]:
    """The eager steps' counterpart of the static step's sampling: ``logits`` ``[n, vocab]`` float32 on
    the device, one token id per row (one device-to-host copy)."""
    return sample_rows_with_logprobs(logits, rows, steps, penalties, masks=masks)[0]


def sample_rows_with_logprobs(
    logits: Tensor,
    rows: list[RowSampling],
    steps: list[int],
    penalties: list[Penalties | None] | None = None,
    tops: list[int | None] | None = None,
    masks: Sequence[np.ndarray | None] = (),
) -> tuple[list[int], list[SampledLogprobs | None]]:
    """:func:`sample_rows`, plus the logprobs of the rows whose ``tops`` entry is not None (that many
    alternatives each): see :func:`tokens_and_logprobs`. Still one device-to-host copy."""
    buffers = SamplingBuffers(len(rows), logits.device)
    sampled = buffers.fill(rows, steps)
    if penalties is not None and buffers.fill_penalties(penalties, logits.shape[-1]):
        logits = buffers.penalize(logits)  # what the tokens are drawn from, and the logprobs are of
    constrained = bool(masks) and buffers.fill_masks(masks, logits.shape[-1])  # the mask: after the logprobs
    chosen = buffers.sample(logits, sampled=sampled, constrained=constrained)
    return tokens_and_logprobs(chosen, logits, tops or [])


def tokens_and_logprobs(
    tokens: Tensor, logits: Tensor, tops: list[int | None]
) -> tuple[list[int], list[SampledLogprobs | None]]:
    """The step's token ids ``tokens`` ``[n]`` (int64, on the device) and, for each row ``i`` with
    ``tops[i]`` not None, the logprob of its token under ``logits[i]`` (the penalised logits it was drawn
    from) with its ``tops[i]`` most likely tokens, most likely first.

    The log-softmax and ``topk`` run on the device over those rows only; ids and numbers travel back
    together as one float64 tensor (ids below 2**53 are exact), so a step still makes one device-to-host
    copy. Rows without an entry in ``tops`` (or ``tops`` shorter than the batch) get None.
    """
    n = tokens.shape[0]
    wanted = [i for i, top in enumerate(tops[:n]) if top is not None]
    if not wanted:
        return [int(t) for t in tokens.tolist()], [None] * n
    k = max(int(tops[i] or 0) for i in wanted)
    index = torch.tensor(wanted, dtype=torch.int64, device=logits.device)
    scores = torch.log_softmax(logits.index_select(0, index).to(torch.float32), dim=-1)
    chosen = scores.gather(1, tokens.index_select(0, index)[:, None]).squeeze(1)
    parts = [tokens.to(torch.float64), chosen.to(torch.float64)]
    if k:
        values, ids = scores.topk(min(k, scores.shape[-1]), dim=-1)
        parts += [values.to(torch.float64).flatten(), ids.to(torch.float64).flatten()]
    flat = torch.cat(parts).tolist()
    ids_out = [int(t) for t in flat[:n]]
    out: list[SampledLogprobs | None] = [None] * n
    m = len(wanted)
    width = min(k, scores.shape[-1])
    for j, i in enumerate(wanted):
        top = int(tops[i] or 0)
        base = n + m + j * width
        top_ids = [int(t) for t in flat[base + m * width : base + m * width + top]] if top else []
        top_lps = flat[base : base + top] if top else []
        out[i] = SampledLogprobs(ids_out[i], flat[n + j], top_ids, top_lps)
    return ids_out, out
