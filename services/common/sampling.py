"""Sampling parameters: the one type every service uses, its one validator, and every limit once.

A public request's ``meshserve.v1.SamplingParams`` becomes a :class:`SamplingParams` at the service
edge that receives it (:mod:`services.common.sampling_pb`), through :func:`resolve_sampling`, the
only place a sampling range is checked or a neutral value applied; it records which fields the
request left unset (:attr:`SamplingParams.defaulted`), which the router fills with the served model's
generation defaults (:mod:`services.common.generation_defaults`). The gateway runs the same checks with
its operator's tighter :class:`SamplingLimits`; the router and the workers fit ``max_tokens`` to
the model's context (:meth:`SamplingParams.fit`), which only they know after tokenizing.

Messages are shown to callers (INVALID_ARGUMENT): one sentence that names the field, its limit and
the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from services.common.constraints import Constraint
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
MAX_ABS_PENALTY = 2.0
"""``frequency_penalty`` and ``presence_penalty`` lie in [-2, 2] (OpenAI's bounds)."""
MAX_REPETITION_PENALTY = 2.0
"""Largest ``repetition_penalty`` (it must be > 0; 1 disables it). vLLM sets no upper bound; past 2
a seen token's logit is more than halved and the output degenerates, so 2 bounds it here."""
MAX_LOGIT_BIAS = 100.0
"""``logit_bias`` values lie in [-100, 100] (OpenAI's bounds): -100 bans a token, +100 forces it."""
MAX_LOGIT_BIAS_ENTRIES = 300
"""Most ``logit_bias`` entries per request (OpenAI's limit)."""
MAX_TOKEN_ID = 2**31 - 1
"""Largest token id a ``logit_bias`` key may name before the model's vocabulary is known (the router
and the workers then check it against the vocabulary: :meth:`SamplingParams.fit`)."""
MAX_CHOICES = 16
"""Most choices (``n``) per request: the n sequences share the prompt's KV, and each needs a generation
slot of the worker (an edge worker runs 16 rows per decode call)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask for with ``top_logprobs`` (OpenAI's chat limit; its
legacy completions allow 5, which the HTTP adapter checks)."""


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

DEFAULTABLE = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "stop")
"""The fields a served model has defaults for (docs/router.md, *Generation defaults*); a request that
leaves one unset gets the model's value, and a field it sets always wins."""


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
    frequency_penalty: float = 0.0
    """OpenAI's: each token's logit minus this times how often it appears among the tokens generated
    so far (the prompt not counted); [-2, 2], 0 disables it."""
    presence_penalty: float = 0.0
    """OpenAI's: each token generated so far has its logit lowered by this once; [-2, 2], 0 disables it."""
    repetition_penalty: float = 1.0
    """vLLM's and transformers': a token of the prompt or of the tokens generated so far has a positive
    logit divided by it, a negative one multiplied by it; (0, 2], 1 disables it."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs sorted by id, added to the logits before the penalties (OpenAI's);
    biases in [-100, 100], at most 300 entries."""
    min_tokens: int = 0
    """EOS and the stop strings are ignored until this many tokens have been generated (vLLM's)."""
    logprobs: bool = False
    """Return each generated token's logprob (:mod:`services.common.logprobs` says of which distribution)."""
    top_logprobs: int = 0
    """With ``logprobs``: also the this-many most likely tokens at each position, 0 to 20."""
    structured: Constraint | None = None
    """Structured output: the generated text must match this JSON schema / JSON object / regex /
    grammar (:mod:`services.common.constraints`); the worker masks each step's logits to it."""
    n: int = 1
    """Choices to generate (OpenAI's ``n``), 1 to :data:`MAX_CHOICES`; they share the prompt's prefill.
    Choice ``i`` samples with :meth:`choice` ``(i)``'s parameters."""
    defaulted: frozenset[str] = frozenset()
    """The fields of :data:`DEFAULTABLE` the request left unset: they hold the mesh's neutral value until
    the router fills them with the served model's defaults
    (:meth:`services.common.generation_defaults.GenerationDefaults.apply`), which empties this set.
    Parameters built directly (tests, benchmarks, warm-ups) have none: every field is explicit."""

    def choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of an n-choice request: ``n`` 1, and with a seed,
        ``(seed + index) mod 2**64`` (so seeded choices are reproducible and differ from each other;
        choice 0 of a seeded request samples exactly as the same request with n = 1)."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return replace(self, n=1, seed=seed)

    @property
    def penalized(self) -> bool:
        """Whether any penalty, bias or ``min_tokens`` changes the logits (the samplers' slow path)."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

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
        stop strings are a set. Penalties, ``logit_bias``, ``min_tokens`` and a structured-output
        constraint (as its kind and digest) change greedy output too:
        each is in the key whenever it is not neutral (and absent when neutral, so keys made before
        these fields existed still match).
        """
        out: dict[str, object] = {
            "max_tokens": int(self.max_tokens),
            "stop": sorted(set(self.stop)),
        }
        if self.frequency_penalty != 0.0:
            out["frequency_penalty"] = _round(self.frequency_penalty)
        if self.presence_penalty != 0.0:
            out["presence_penalty"] = _round(self.presence_penalty)
        if self.repetition_penalty != 1.0:
            out["repetition_penalty"] = _round(self.repetition_penalty)
        if self.logit_bias:
            out["logit_bias"] = [[int(t), _round(b)] for t, b in self.logit_bias]
        if self.min_tokens:
            out["min_tokens"] = int(self.min_tokens)
        if self.structured is not None:
            out["structured"] = self.structured.canonical()
        if self.n != 1:
            out["n"] = int(self.n)
        if self.logprobs:  # the router never caches these answers; the key still differs (collapsing)
            out["logprobs"] = int(self.top_logprobs)
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
        self,
        prompt_tokens: int,
        context_length: int,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        vocab_size: int | None = None,
    ) -> SamplingParams:
        """These parameters with ``max_tokens`` fitted to the room ``prompt_tokens`` leave in the context.

        A default ``max_tokens`` (0) becomes ``default_max_tokens``, clamped to the room (and raised to
        ``min_tokens`` where that fits); an explicit one that does not fit is an error, as is a prompt
        that leaves no room at all, a ``min_tokens`` that does not fit, and (given ``vocab_size``) a
        ``logit_bias`` token id outside the vocabulary.
        """
        room = context_length - prompt_tokens
        if room <= 0:
            raise InvalidArgument(
                f"the prompt has {prompt_tokens} tokens but the model context holds {context_length}; shorten it"
            )
        if vocab_size is not None and self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise InvalidArgument(
                f"sampling.logit_bias names token id {self.logit_bias[-1][0]}, outside the model's vocabulary of "
                f"{vocab_size} tokens; use ids below {vocab_size}"
            )
        if self.min_tokens > room:
            raise InvalidArgument(
                f"prompt ({prompt_tokens} tokens) + min_tokens ({self.min_tokens}) exceeds the model context of "
                f"{context_length} tokens; lower min_tokens to at most {room} or shorten the prompt"
            )
        if self.max_tokens == 0:
            return replace(self, max_tokens=min(max(default_max_tokens, self.min_tokens), room))
        if self.max_tokens > room:
            raise InvalidArgument(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({self.max_tokens}) exceeds the model context of "
                f"{context_length} tokens; lower max_tokens to at most {room} or shorten the prompt"
            )
        return self


def resolve_sampling(
    *,
    max_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    structured: Constraint | None = None,
    n: int = 1,
    logprobs: bool = False,
    top_logprobs: int = 0,
    limits: SamplingLimits = MESH_LIMITS,
) -> SamplingParams:
    """Check a caller's sampling values against ``limits`` and apply the documented neutral values.

    A field of :data:`DEFAULTABLE` the caller left unset (None; ``max_tokens`` 0; no stop strings) gets
    its neutral value (greedy, top_p 1, top_k 0, repetition_penalty 1) and is named in
    :attr:`SamplingParams.defaulted`: the router replaces it with the served model's default, once.
    ``top_p`` 0 means 1 (off); ``max_tokens`` stays 0 until :meth:`SamplingParams.fit` (only a service
    that knows the prompt's length can fit it). Duplicate stop strings are dropped (first occurrence
    kept). ``structured`` is a constraint already checked by
    :func:`services.common.constraints.check_constraint`. Raises :class:`InvalidArgument` naming the field.
    """
    unset = {
        name
        for name, value in (
            ("temperature", temperature),
            ("top_p", top_p),
            ("top_k", top_k),
            ("repetition_penalty", repetition_penalty),
        )
        if value is None
    }
    if not max_tokens:
        unset.add("max_tokens")
    if not stop:
        unset.add("stop")
    temperature = 0.0 if temperature is None else temperature
    top_p = 0.0 if top_p is None else top_p
    top_k = 0 if top_k is None else top_k
    repetition_penalty = 1.0 if repetition_penalty is None else repetition_penalty
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
    for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if not math.isfinite(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
            raise InvalidArgument(
                f"sampling.{name} must be between {-MAX_ABS_PENALTY:g} and {MAX_ABS_PENALTY:g} (got {value:g}); "
                "use 0 to disable it"
            )
    if not math.isfinite(repetition_penalty) or not 0.0 < repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(
            f"sampling.repetition_penalty must be above 0 and at most {MAX_REPETITION_PENALTY:g} "
            f"(got {repetition_penalty:g}); use 1 to disable it"
        )
    bias = dict(logit_bias or {})
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(f"sampling.logit_bias has {len(bias)} entries; send at most {MAX_LOGIT_BIAS_ENTRIES}")
    for token, value in bias.items():
        if not 0 <= token <= MAX_TOKEN_ID:
            raise InvalidArgument(
                f"sampling.logit_bias names token id {token}; token ids are between 0 and the vocabulary size - 1"
            )
        if not math.isfinite(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidArgument(
                f"sampling.logit_bias for token {token} is {value:g}; biases must be between "
                f"{-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}"
            )
    if min_tokens < 0:
        raise InvalidArgument(f"sampling.min_tokens must be >= 0 (got {min_tokens}); use 0 to disable it")
    if max_tokens and min_tokens > max_tokens:
        raise InvalidArgument(
            f"sampling.min_tokens ({min_tokens}) is above sampling.max_tokens ({max_tokens}); "
            "lower min_tokens or raise max_tokens"
        )
    if min_tokens and structured is not None:
        raise InvalidArgument(
            "sampling.min_tokens cannot be combined with structured output (response_format / sampling.structured): "
            "the grammar decides where the output ends; remove min_tokens"
        )
    if limits.max_tokens is not None and min_tokens > limits.max_tokens:
        raise InvalidArgument(
            f"sampling.min_tokens is {min_tokens}, above the limit of {limits.max_tokens}; ask for fewer"
        )
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidArgument(f"sampling.n must be between 1 and {MAX_CHOICES} (got {n}); ask for fewer choices")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            f"sampling.top_logprobs must be between 0 and {MAX_TOP_LOGPROBS} (got {top_logprobs}); ask for fewer"
        )
    if top_logprobs and not logprobs:
        raise InvalidArgument(
            "sampling.top_logprobs needs sampling.logprobs; set logprobs to true or drop top_logprobs"
        )
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(temperature),
        top_p=1.0 if top_p == 0.0 else float(top_p),
        top_k=int(top_k),
        seed=None if seed is None else int(seed),
        stop=tuple(dict.fromkeys(stop)),
        frequency_penalty=float(frequency_penalty),
        presence_penalty=float(presence_penalty),
        repetition_penalty=float(repetition_penalty),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in bias.items() if b != 0.0)),
        min_tokens=int(min_tokens),
        structured=structured,
        n=int(n),
        logprobs=bool(logprobs),
        top_logprobs=int(top_logprobs),
        defaulted=frozenset(unset),
    )


def _round(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError(f"sampling parameter must be finite, got {x!r}")
    return round(float(x), 6)
