"""Tokenizing on the router's request path: short prompts inline, long ones off the event loop, and the
LRU of recently seen prompts' token ids (a repeated prompt skips the tokenizer)."""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Callable

# Tokenizing a long prompt takes milliseconds: do it off the event loop past this many characters.
INLINE_TOKENIZE_CHARS = 4096
# Recently seen prompts (up to the inline size) keep their token ids: a repeated prompt (a cache hit,
# a client retrying) skips the tokenizer, whose call costs more than the rest of a cache hit.
ENCODED_PROMPTS = 2048
# ...and at most this many token ids in all, kept as int32 (4 MiB): distinct 4 KiB prompts of one-char
# tokens would otherwise hold ~150 KiB each as tuples of ints (~300 MiB for the 2048 entries).
_ENCODED_TOKENS = 1 << 20


class EncodeCache:
    """LRU of prompt text -> token ids, bounded by entries and by token ids held (each prompt is at most
    the inline size, so the texts hold at most ``size`` x 4 KiB characters)."""

    def __init__(self, size: int, max_tokens: int = _ENCODED_TOKENS) -> None:
        self._size = size
        self._max_tokens = max_tokens
        self._ids: OrderedDict[str, array[int]] = OrderedDict()
        self.tokens = 0
        """Token ids held now."""

    def get(self, text: str) -> list[int] | None:
        ids = self._ids.get(text)
        if ids is None:
            return None
        self._ids.move_to_end(text)
        return ids.tolist()

    def put(self, text: str, ids: list[int]) -> None:
        if len(ids) > self._max_tokens:
            return
        old = self._ids.pop(text, None)
        if old is not None:
            self.tokens -= len(old)
        self._ids[text] = array("i", ids)
        self.tokens += len(ids)
        while len(self._ids) > self._size or self.tokens > self._max_tokens:
            _, gone = self._ids.popitem(last=False)
            self.tokens -= len(gone)


async def tokenize(fn: Callable[[], list[int]], size: int) -> list[int]:
    """``fn()`` (a tokenizer call over ``size`` characters): inline up to :data:`INLINE_TOKENIZE_CHARS`,
    else in a thread, so a long prompt does not hold the event loop for milliseconds."""
    return fn() if size <= INLINE_TOKENIZE_CHARS else await asyncio.to_thread(fn)
