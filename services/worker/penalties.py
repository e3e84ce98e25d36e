"""One sequence's logit adjustments: ``logit_bias``, repetition / frequency / presence penalties, ``min_tokens``.

Both tiers' samplers apply them to a sequence's logits row before choosing its token (the edge
engine's numpy sampler, the cloud engine's host sampler and its on-device batch sampler), in vLLM's
order: the bias is added, then a token seen in the prompt or the output so far has a positive logit
divided by ``repetition_penalty`` and a negative one multiplied by it (transformers' and vLLM's rule),
then ``frequency_penalty * count + presence_penalty * (count > 0)`` is subtracted over the generated
tokens only (OpenAI's rule), and while fewer than ``min_tokens`` tokens have been generated the EOS
tokens are banned (-inf).

Under structured output (``sampling.structured``: a JSON schema or object, a regex, a grammar, a tool
call's constraint) the repetition penalty counts the generated tokens only, never the prompt: the
constrained text must often copy the prompt's words (a JSON value, a tool argument), and a penalty on
them makes the model pick other words the grammar allows (docs/structured_output.md, *Penalties*). A
model's default penalty does not reach a constrained turn at all (the router leaves it out:
services/common/generation_defaults.py); this rule is for a penalty the request set itself.

The state is sparse (the distinct tokens seen, not a vocabulary-sized row), updated by one
:meth:`Penalties.record` per token, so a step costs O(distinct tokens) per penalised row and nothing
for the others. Why our own and not transformers' processors: they take the whole ``input_ids`` every
step (O(length) per token), have no frequency/presence penalty, and the device sampler needs the same
numbers as sparse per-row updates of its static buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from services.common.sampling import SamplingParams


class Penalties:
    """The adjustments of one sequence; the thread that samples it calls :meth:`record` per token."""

    def __init__(self, sampling: SamplingParams, prompt_ids: Iterable[int], eos_ids: Iterable[int]) -> None:
        self.repetition = float(sampling.repetition_penalty)
        self.frequency = float(sampling.frequency_penalty)
        self.presence = float(sampling.presence_penalty)
        self.min_tokens = int(sampling.min_tokens)
        self.bias_ids = np.array([t for t, _ in sampling.logit_bias], dtype=np.int64)
        self.bias_values = np.array([b for _, b in sampling.logit_bias], dtype=np.float32)
        self.eos_ids = np.array(sorted(eos_ids), dtype=np.int64)
        self.generated = 0
        """Tokens generated so far in this turn (resumed ones included)."""
        self._pos: dict[int, int] = {}
        self._ids = np.zeros(64, dtype=np.int64)
        self._counts = np.zeros(64, dtype=np.float32)  # times generated (0: seen in the prompt only)
        self._n = 0
        if self.repetition != 1.0 and sampling.structured is None:  # only this penalty looks at the prompt
            for token in prompt_ids:
                self._track(int(token))

    def _track(self, token: int) -> int:
        pos = self._pos.get(token)
        if pos is None:
            pos = self._n
            if pos == self._ids.size:
                self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._ids[pos] = token
            self._pos[token] = pos
            self._n += 1
        return pos

    def record(self, token: int) -> None:
        """``token`` was generated (or replayed, for a resumed stream)."""
        self.generated += 1
        if self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0:
            pos = self._track(int(token))  # before indexing: tracking may grow (replace) the arrays
            self._counts[pos] += 1.0

    @property
    def seen_ids(self) -> np.ndarray:
        """Distinct tokens of the prompt (when the repetition penalty is on and the turn unconstrained) and
        of the output so far."""
        return self._ids[: self._n]

    def post_values(self) -> np.ndarray:
        """What is added to each of :attr:`seen_ids` after the repetition scaling (minus the
        frequency and presence penalties); float32."""
        counts = self._counts[: self._n]
        return -(self.frequency * counts + self.presence * (counts > 0)).astype(np.float32)

    @property
    def eos_banned(self) -> bool:
        """EOS may not be chosen yet (``min_tokens`` not reached)."""
        return self.generated < self.min_tokens and self.eos_ids.size > 0

    def apply(self, logits: np.ndarray, *, in_place: bool = False) -> np.ndarray:
        """A ``[vocab]`` row adjusted: a new float32 array, or (``in_place``, for a writable float32 row
        the caller discards afterwards) ``logits`` itself, which saves copying the row every step."""
        if in_place and logits.dtype == np.float32 and logits.flags.writeable:
            out = logits
        else:
            out = np.array(logits, dtype=np.float32, copy=True)
        if self.bias_ids.size:
            out[self.bias_ids] += self.bias_values
        if self._n:
            ids = self.seen_ids
            if self.repetition != 1.0:
                seen = out[ids]
                out[ids] = np.where(seen > 0, seen / self.repetition, seen * self.repetition)
            if self.frequency != 0.0 or self.presence != 0.0:
                out[ids] += self.post_values()
        if self.eos_banned:
            out[self.eos_ids] = -np.inf
        return out


def penalties_for(sampling: SamplingParams, prompt_ids: Iterable[int], eos_ids: Iterable[int]) -> Penalties | None:
    """The sequence's adjustments, or None when ``sampling`` has none (the samplers' fast path)."""
    return Penalties(sampling, prompt_ids, eos_ids) if sampling.penalized else None
