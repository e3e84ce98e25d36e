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
    token's bytes (:class:`Detokenizers`' table) through an incremental UTF-8 decoder, special tokens
    skipped. About a tenth of :class:`IncrementalDetokenizer`'s two ``decode`` calls per token; the
    concatenation is exactly what decoding all of the tokens at once gives (tested on the real
    tokenizer), and a character is released as soon as its last byte comes."""

    def __init__(self, table: dict[int, bytes], raw: Callable[[int], bytes]) -> None:
        self._table = table
        self._raw = raw
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def _bytes(self, token: int) -> bytes:
        found = self._table.get(token)
        if found is None:
            found = self._table[token] = self._raw(token)
        return found

    def add(self, token_id: int) -> str:
        """Text released by ``token_id`` (empty while a multi-byte character is incomplete)."""
        return self._decoder.decode(self._bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        return self._decoder.decode(b"", final=True)


class Detokenizers:
    """Makes the detokenizer of each sequence for one tokenizer: :class:`ByteLevelDetokenizer` when the
    tokenizer is a byte-level BPE whose added tokens are all special (what ``decode`` then does is
    known exactly), else :class:`IncrementalDetokenizer`. The byte table is shared by all sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._table: dict[int, bytes] = {}
        decoder = getattr(tokenizer, "decoder", None)  # a tokenizers.Tokenizer's pipeline (test fakes have none)
        added = getattr(tokenizer, "get_added_tokens_decoder", None)
        self._piece: Callable[[int], str | None] | None = None
        if type(decoder).__name__ == "ByteLevel" and added is not None:
            specials = added()
            if all(token.special for token in specials.values()):
                self._table.update({token_id: b"" for token_id in specials})
                self._piece = tokenizer.id_to_token  # type: ignore[attr-defined]
                self._bytes_of = byte_level()

    @property
    def fast(self) -> bool:
        return self._piece is not None

    def _raw(self, token: int) -> bytes:
        assert self._piece is not None
        piece = self._piece(token)
        if piece is None:
            return b""
        return bytes(self._bytes_of[c] for c in piece)

    def new(self, context_ids: Sequence[int] = ()) -> IncrementalDetokenizer | ByteLevelDetokenizer:
        if self._piece is None:
            return IncrementalDetokenizer(self._tok, context_ids)
        return ByteLevelDetokenizer(self._table, self._raw)  # a byte-level decoder needs no context


def byte_level() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: printable character -> the byte it stands for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}
