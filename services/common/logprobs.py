"""Per-token log probabilities: the one type every service passes on (``SamplingParams.logprobs``).

A worker's sampler computes them (:class:`SampledLogprobs`: ids and numbers only), the worker, which
holds the tokenizer, adds each token's text and UTF-8 bytes (:class:`TokenLogprob`), and from there
they travel unchanged through the router and the gateway to the caller, so nothing further in needs a
tokenizer. Wire form: ``meshserve.v1.TokenLogprob`` (:mod:`services.common.logprobs_pb`).

Which distribution: the log-softmax of the logits the token was drawn from after ``logit_bias`` and
the penalties (``min_tokens``' EOS ban included), before temperature, top-k and top-p, so the numbers
do not depend on the sampling knobs (OpenAI's logprobs do not either). vLLM by default returns the raw
model's instead (``logprobs_mode=raw_logprobs``); docs/gateway.md "Logprobs" says why this mesh does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    """What a sampler knows of one chosen token: its logprob and the top-k of its row (ids, logprobs,
    most likely first; empty for k = 0)."""

    token_id: int
    logprob: float
    top_ids: Sequence[int] = ()
    top_logprobs: Sequence[float] = ()


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    token: str
    """The token decoded alone; not whole UTF-8: ``bytes:`` and ``\\xNN`` escapes (OpenAI's way)."""
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of one generated token, with its text, its bytes and the top alternatives."""

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


def token_text(raw: bytes) -> str:
    """How a token's bytes are shown as a string: decoded when they are whole UTF-8, else OpenAI's
    ``bytes:\\xNN...`` form (a byte-level token may hold part of a multi-byte character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
