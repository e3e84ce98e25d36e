"""Incremental detokenization: token ids in, text deltas out, never a half UTF-8 character.

Our own rather than ``tokenizers.decoders.DecodeStream`` because it must start from context (the
prompt's last tokens), so that tokenizers whose decoders strip a leading space at the start of a
text (SentencePiece/Metaspace) still produce the right first delta; and it works over any object
with ``decode`` (test fakes). Same offsets scheme as TGI/vLLM: decode a small window twice and emit
the difference once it no longer ends in U+FFFD.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from services.worker.token_texts import TokenTexts
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


class ByteLevelDetokenizer:
    """The same deltas for a byte-level BPE tokenizer (GPT-2's, SmolLM2's) without calling it: each
    token's bytes (:class:`~services.worker.token_texts.TokenTexts`) through an incremental UTF-8
    decoder, special tokens skipped. About a tenth of :class:`IncrementalDetokenizer`'s two ``decode``
    calls per token; the concatenation is exactly what decoding all of the tokens at once gives (tested
    on the real tokenizer), and a character is released as soon as its last byte comes."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        """Text released by ``token_id`` (empty while a multi-byte character is incomplete)."""
        return self._decoder.decode(self._bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        return self._decoder.decode(b"", final=True)


class Detokenizers:
    """Makes the detokenizer of each sequence for one tokenizer: :class:`ByteLevelDetokenizer` when the
    tokenizer is a byte-level BPE whose added tokens are all special (what ``decode`` then does is
    known exactly: each token's bytes, specials skipped), else :class:`IncrementalDetokenizer`."""

    def __init__(self, tokenizer: Tokenizer, texts: TokenTexts) -> None:
        self._tok = tokenizer
        self._texts = texts
        added = getattr(tokenizer, "get_added_tokens_decoder", None)  # tokenizers.Tokenizer's (fakes have none)
        specials = added() if added is not None else None
        self.fast = texts.byte_level and specials is not None and all(t.special for t in specials.values())
        self._skip = frozenset(specials or ())

    def _bytes(self, token: int) -> bytes:
        return b"" if token in self._skip else self._texts.get(token)[1]

    def new(self, context_ids: Sequence[int] = ()) -> IncrementalDetokenizer | ByteLevelDetokenizer:
        if not self.fast:
            return IncrementalDetokenizer(self._tok, context_ids)
        return ByteLevelDetokenizer(self._bytes)  # a byte-level decoder needs no context
