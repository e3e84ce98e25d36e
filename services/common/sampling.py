"""Sampling parameters: the one type every service uses, its one validator, and every limit once.

A public request's ``meshserve.v1.SamplingParams`` becomes a :class:`SamplingParams` at the service
edge that receives it (:mod:`services.common.sampling_pb`), through :func:`resolve_sampling`, the
only place a sampling range is checked or a default applied. The gateway runs the same checks with
its operator's tighter :class:`SamplingLimits`; the router and the workers fit ``max_tokens`` to
the model's context (:meth:`SamplingParams.fit`), which only they know after tokenizing.

Messages are shown to callers (INVALID_ARGUMENT): one sentence that names the field, its limit and
the fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.common.errors import InvalidArgument

DEFAULT_MAX_TOKENS = 256
"""Tokens generated when a request leaves ``max_tokens`` at 0 (the proto's documented default),
fewer where the prompt leaves less room in the context."""
MAX_STOP_STRINGS = 8
"""Most stop strings per request (the proto promises "at most 8")."""
MAX_STOP_CHARS = 64
"""Longest stop string, in characters.

64 is the limit public callers have always met at the gateway (docs/gateway.md,
``MESHSERVE_GATEWAY_MAX_STOP_CHARS``); the router's and workers' own 256 was only reachable by
calling them directly. One limit everywhere means a request the gateway accepts is never refused
further in, and a worker holds back at most 63 characters of text while it waits to see whether a
stop string completes."""
MIN_TEMPERATURE = 0.0
"""Lowest softmax temperature: 0 is greedy (argmax) decoding."""
MAX_TEMPERATURE = 2.0
"""Highest softmax temperature (OpenAI's bound too)."""
MAX_TOP_K = 2**32 - 1
"""Largest ``top_k`` (the wire's uint32); any value at or above the vocabulary size disables it."""
MAX_SEED = 2**64 - 1
"""Largest seed (the wire's uint64); seeds start at 0."""


@dataclass(frozen=True)
class SamplingLimits:
    """Bounds a request's sampling must respect. The defaults are the mesh's; an operator may only
    tighten them (the gateway's settings), never widen them past the constants above."""

    max_tokens: int | None = None
    """Largest ``max_tokens`` a caller may ask for; None: only the model's context bounds it."""
    max_stop_strings: int = MAX_STOP_STRINGS
    """Most stop strings per request."""
    max_stop_chars: int = MAX_STOP_CHARS
    """Longest stop string, in characters."""


MESH_LIMITS = SamplingLimits()
"""The mesh-wide limits (the router's and the workers')."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one turn's continuation, with defaults applied and every range checked.

    Build it with :func:`resolve_sampling` from a caller's values; construct it directly only from
    values known to be valid (tests, benchmarks, internal warm-ups).
    """

    max_tokens: int
    """Tokens to generate at most in this turn. 0 only before :meth:`fit`: the server default,
    fitted to the room the prompt leaves in the context."""
    temperature: float = 0.0
    """Softmax temperature in [0, 2]; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus probability mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables it, 1 is greedy decoding."""
    seed: int | None = None
    """Seed of the sequence's own random generator (0 to 2**64-1); None draws a fresh one."""
    stop: tuple[str, ...] = ()
    """Generation stops before the first occurrence of any of these strings (no duplicates)."""

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or only the single most likely token to choose from."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def deterministic(self) -> bool:
        """Same prompt, same output: greedy decoding, or sampling with a fixed seed."""
        return self.greedy or self.seed is not None

    def canonical(self) -> dict[str, object]:
        """A normal form (the response-cache key's): equal for parameter sets that produce the same tokens.

        Floats are rounded to 6 digits (proto float32 values like 0.7 arrive as 0.699999988); with
        greedy decoding temperature/top_p/top_k/seed cannot change the output, so they are dropped;
        stop strings are a set.
        """
        out: dict[str, object] = {
            "max_tokens": int(self.max_tokens),
            "stop": sorted(set(self.stop)),
        }
        if self.greedy:
            out["temperature"] = 0
            return out
        top_p = 1.0 if self.top_p <= 0 or self.top_p >= 1 else self.top_p
        out.update(
            temperature=_round(self.temperature),
            top_p=_round(top_p),
            top_k=int(self.top_k),
            seed=self.seed,
        )
        return out

    def fit(
        self, prompt_tokens: int, context_length: int, default_max_tokens: int = DEFAULT_MAX_TOKENS
    ) -> SamplingParams:
        """These parameters with ``max_tokens`` fitted to the room ``prompt_tokens`` leave in the context.

        A default ``max_tokens`` (0) becomes ``default_max_tokens``, clamped to the room; an explicit
        one that does not fit is an error, as is a prompt that leaves no room at all.
        """
        room = context_length - prompt_tokens
        if room <= 0:
            raise InvalidArgument(
                f"the prompt has {prompt_tokens} tokens but the model context holds {context_length}; shorten it"
            )
        if self.max_tokens == 0:
            return replace(self, max_tokens=min(default_max_tokens, room))
        if self.max_tokens > room:
            raise InvalidArgument(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({self.max_tokens}) exceeds the model context of "
                f"{context_length} tokens; lower max_tokens to at most {room} or shorten the prompt"
            )
        return self


def resolve_sampling(
    *,
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    limits: SamplingLimits = MESH_LIMITS,
) -> SamplingParams:
    """Check a caller's sampling values against ``limits`` and apply the documented defaults.

    The zero values mean "default" as the proto documents: top_p 0 -> 1, max_tokens 0 stays 0 until
    :meth:`SamplingParams.fit` (only a service that knows the prompt's length can fit it). Duplicate
    stop strings are dropped (first occurrence kept). Raises :class:`InvalidArgument` naming the field.
    """
    if max_tokens < 0:
        raise InvalidArgument(f"sampling.max_tokens must be >= 0 (got {max_tokens}); use 0 for the server default")
    if limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise InvalidArgument(
            f"sampling.max_tokens is {max_tokens}, above the limit of {limits.max_tokens}; ask for fewer"
        )
    if not math.isfinite(temperature) or not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(
            f"sampling.temperature must be between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g} "
            f"(got {temperature:g}); use 0 for greedy decoding"
        )
    if not math.isfinite(top_p) or not 0.0 <= top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p must be between 0 and 1 (got {top_p:g}); 0 or 1 disables it")
    if not 0 <= top_k <= MAX_TOP_K:
        raise InvalidArgument(f"sampling.top_k must be between 0 and {MAX_TOP_K} (got {top_k}); use 0 to disable it")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise InvalidArgument(f"sampling.seed must be between 0 and {MAX_SEED} (got {seed}); pick another seed")
    if len(stop) > limits.max_stop_strings:
        raise InvalidArgument(f"sampling.stop has {len(stop)} stop strings; send at most {limits.max_stop_strings}")
    for s in stop:
        if not s:
            raise InvalidArgument("sampling.stop contains an empty stop string; remove it")
        if len(s) > limits.max_stop_chars:
            raise InvalidArgument(
                f"a stop string is {len(s)} characters long; keep each stop string to at most "
                f"{limits.max_stop_chars} characters"
            )
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(temperature),
        top_p=1.0 if top_p == 0.0 else float(top_p),
        top_k=int(top_k),
        seed=None if seed is None else int(seed),
        stop=tuple(dict.fromkeys(stop)),
    )


def _round(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError(f"sampling parameter must be finite, got {x!r}")
    return round(float(x), 6)
