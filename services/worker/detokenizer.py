"""Incremental detokenization: token ids in, text deltas out, never a half UTF-8 character.

Our own rather than ``tokenizers.decoders.DecodeStream`` because it must start from context (the
prompt's last tokens), so that tokenizers whose decoders strip a leading space at the start of a
text (SentencePiece/Metaspace) still produce the right first delta; and it works over any object
with ``decode`` (test fakes). Same offsets scheme as TGI/vLLM: decode a small window twice and emit
the difference once it no longer ends in U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.worker.types import Tokenizer

_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated ids into text deltas; the concatenation equals decoding all of them at once."""

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(context_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        """Text released by ``token_id`` (empty while a multi-byte character is incomplete)."""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            if self._prefix > _CONTEXT_TOKENS:  # keep the window small; offsets move with it
                drop = self._prefix - _CONTEXT_TOKENS
                del self._ids[:drop]
                self._prefix -= drop
                self._read -= drop
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        before = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""
