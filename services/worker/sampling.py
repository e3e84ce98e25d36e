"""Defaulting and validation of sampling parameters and prompts, before a turn is admitted.

Messages are shown to callers (INVALID_ARGUMENT): one sentence that says what to change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.common.errors import InvalidArgument
from services.worker.types import EngineInfo, SamplingConfig

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256


def validate_prompt(prompt_ids: Sequence[int], info: EngineInfo) -> None:
    """Reject an empty prompt, a token id outside the vocabulary, or a prompt that fills the context."""
    if not prompt_ids:
        raise InvalidArgument("prompt_token_ids is empty; send at least one token id")
    bad = max(prompt_ids)
    if bad >= info.vocab_size:
        raise InvalidArgument(f"token id {bad} is out of range; model {info.model_id} has {info.vocab_size} tokens")
    if len(prompt_ids) >= info.context_length:
        raise InvalidArgument(
            f"the prompt has {len(prompt_ids)} tokens but the context holds {info.context_length}; shorten it"
        )


def resolve_sampling(
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: Sequence[str],
    prompt_tokens: int,
    info: EngineInfo,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> SamplingConfig:
    """Apply the documented defaults (0 = default) and check ranges.

    An explicit ``max_tokens`` that does not fit after the prompt is an error; the default is
    clamped to the room left in the context.
    """
    room = info.context_length - prompt_tokens
    if max_tokens == 0:
        max_tokens = max(1, min(default_max_tokens, room))
    elif max_tokens > room:
        raise InvalidArgument(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model context of "
            f"{info.context_length} tokens; lower max_tokens to at most {max(room, 0)}"
        )
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 2.0:
        raise InvalidArgument(f"temperature must be between 0 and 2 (got {temperature}); use 0 for greedy")
    if not math.isfinite(top_p) or not 0.0 <= top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1] (got {top_p}); use 0 or 1 to disable it")
    if top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0 (got {top_k}); use 0 to disable it")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(stop)})")
    for s in stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return SamplingConfig(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=1.0 if top_p == 0.0 else float(top_p),
        top_k=int(top_k),
        seed=seed,
        stop=tuple(dict.fromkeys(stop)),
    )
