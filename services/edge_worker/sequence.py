"""One sequence of the batched edge engine (:mod:`services.edge_worker.ort_engine`): its tokens, where
its KV is (a slot, or parked), its sampler state, and the chat reuse rule. Only the engine loop
thread touches it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams
from services.edge_worker.sampler import rng_for
from services.worker.penalties import Penalties, penalties_for
from services.worker.types import NewSequence


def _reusable_key(sampling: SamplingParams, constrained: bool) -> tuple[Any, ...] | None:
    """Turns with equal keys may share a sequence; None (an explicit seed, a structured-output
    constraint: its grammar state starts with the turn) never shares one."""
    if constrained:
        return None
    if sampling.greedy:
        return ("greedy",)
    if sampling.seed is not None:
        return None  # a seeded turn must reproduce what a fresh sequence gives (the response cache relies on it)
    return ("sample", sampling.temperature, sampling.top_p, sampling.top_k)


class EdgeSequence:
    """One generation: every token it has (KV for the first ``kv_len``) and how it samples the next."""

    def __init__(self, spec: NewSequence, eos: frozenset[int]) -> None:
        self.id = spec.id
        self.hold = spec.hold
        self.background = spec.background
        """Background work (a batch line): sits out any step that prefills a sequence not marked so."""
        self.tokens = [*spec.prompt_ids, *spec.replay]
        """Every token of the sequence; KV exists for the first ``kv_len``."""
        self.kv_len = 0
        self.prefill_end = len(spec.prompt_ids)
        """Tokens before this index are prefilled in chunks; later ones (replay) one decode row each."""
        self.slot: int | None = None
        self.parked: list[np.ndarray] | None = None
        self.closed = False
        """Ended and freed (what the background hold reads)."""
        self.last_used = 0.0
        self.source: EdgeSequence | None = None
        """A fork's source until the fork is made (``NewSequence.fork_of``): it never prefills itself."""
        self.forks: list[EdgeSequence] = []
        """Forks waiting for this sequence's prefill (the other choices of an n-choice request)."""
        self._eos = eos
        self.start(spec)

    def start(self, spec: NewSequence) -> None:
        """Take a turn's sampling (a new sequence, or a chat's next turn on a reused one)."""
        self.sampling = spec.sampling
        self.rng = rng_for(spec.sampling)
        self.constraint = spec.constraint
        """Its structured-output grammar state, already advanced over replayed tokens (None: unconstrained)."""
        self.penalties = self._penalties(len(spec.prompt_ids))
        """Its penalties over the prompt and the tokens generated so far (None: none asked for)."""
        self.key = _reusable_key(spec.sampling, spec.constraint is not None)
        self.generated = 0
        self.reported = False
        """Its first token's output said how much it prefilled."""
        self.prefill_tokens = len(self.tokens) - self.kv_len
        """Tokens computed before its first token (the context, or a chat turn's new part)."""
        self.next_logprobs: SampledLogprobs | None = None
        """Set when its token is chosen, with logprobs asked for."""

    def _penalties(self, prompt_len: int) -> Penalties | None:
        penalties = penalties_for(self.sampling, self.tokens[:prompt_len], self._eos)
        if penalties is not None:
            for token in self.tokens[prompt_len:]:  # a resumed stream's replayed tokens were generated
                penalties.record(token)
        return penalties

    def reuse(self, spec: NewSequence, context_length: int) -> bool:
        """Take the chat's next turn over its context; False if this sequence cannot be reused (its
        sampling kind differs, the turn does not fit the context, or nothing is in common). Keeps the
        longest common prefix whose KV exists: the turn prefills only the rest."""
        context = spec.prompt_ids
        key = _reusable_key(spec.sampling, spec.constraint is not None)
        if key is None or key != self.key or spec.replay:
            return False
        if len(context) + spec.sampling.max_tokens > context_length:
            return False
        common = 0
        limit = min(self.kv_len, len(context) - 1)  # at least one token must run to get logits
        while common < limit and self.tokens[common] == context[common]:
            common += 1
        if common == 0:
            return False
        self.id = spec.id
        self.hold = spec.hold
        self.background = spec.background
        self.tokens = list(context)
        self.kv_len = common
        self.prefill_end = len(self.tokens)
        self.start(spec)
        return True

    def done(self, token: int) -> bool:
        """Whether ``token`` (just chosen) ends it: EOS, or its ``max_tokens``."""
        return token in self._eos or self.generated >= self.sampling.max_tokens


def fork_of(source: EdgeSequence, spec: NewSequence, eos: frozenset[int]) -> EdgeSequence:
    """A choice of ``source``'s prompt, made from its prefill (its KV copied when the prefill ends)."""
    fork = EdgeSequence(spec, eos)
    fork.source = source
    fork.prefill_tokens = 0
    return fork
