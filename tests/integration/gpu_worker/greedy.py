"""Plain greedy decoding over ``LlamaModel``'s interface: the reference the TP and speculative tests compare to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.gpu_worker.plan import Segment


def greedy(model: Any, prompt: Sequence[int], max_tokens: int, block_tokens: int = 16) -> list[int]:
    """``max_tokens`` greedy tokens after ``prompt`` (prefill, then one decode step per token)."""
    blocks = (len(prompt) + max_tokens + block_tokens - 1) // block_tokens
    cache = model.new_cache(blocks, block_tokens, model.dtype)
    table = list(range(blocks))
    logits = model.forward([Segment(list(prompt), 0, table)], cache)[0]
    out = [int(logits[-1].argmax())]
    while len(out) < max_tokens:
        logits = model.forward([Segment([out[-1]], len(prompt) + len(out) - 1, table)], cache)[0]
        out.append(int(logits[-1].argmax()))
    if hasattr(model, "free_cache"):
        model.free_cache(cache)
    del cache
    return out
