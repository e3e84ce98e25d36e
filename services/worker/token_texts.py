"""Each token's text and exact UTF-8 bytes, for logprobs frames (the worker holds the tokenizer, so
the router, gateway and HTTP adapter never need one).

Our own because ``tokenizers`` has no "bytes of one token" call: decoding a token alone loses the
bytes of a partial UTF-8 character (U+FFFD). A byte-level BPE vocabulary (GPT-2's, SmolLM2's) spells
every byte as one printable character (``bytes_to_unicode``), which
:func:`byte_level` inverts; a
SentencePiece ``<0xNN>`` piece is its byte; a special (added) token, or any tokenizer without a
vocabulary (test fakes), is its decoded text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.common.logprobs import SampledLogprobs, TokenLogprob, TopLogprob, token_text
from services.worker.types import Tokenizer


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


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), remembered per id (a vocabulary is at most some 10^5 entries)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        decoder: Any = getattr(tokenizer, "decoder", None)
        self._bytes_of = byte_level() if type(decoder).__name__ == "ByteLevel" else None
        self._piece = getattr(tokenizer, "id_to_token", None)
        self.byte_level = self._bytes_of is not None and self._piece is not None
        """A byte-level BPE vocabulary: every token's bytes come from its piece."""

    def get(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._raw(token_id)
            found = self._cache[token_id] = (token_text(raw), raw)
        return found

    def _raw(self, token_id: int) -> bytes:
        piece = self._piece(token_id) if self._piece is not None else None
        if piece:
            if self._bytes_of is not None and all(c in self._bytes_of for c in piece):
                return bytes(self._bytes_of[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def entry(self, sampled: SampledLogprobs) -> TokenLogprob:
        """The frame's entry for one sampled token."""
        text, raw = self.get(sampled.token_id)
        top = self._top(sampled.top_ids, sampled.top_logprobs)
        return TokenLogprob(sampled.token_id, text, raw, sampled.logprob, top)

    def _top(self, ids: Sequence[int], logprobs: Sequence[float]) -> tuple[TopLogprob, ...]:
        out = []
        for token_id, logprob in zip(ids, logprobs, strict=True):
            text, raw = self.get(int(token_id))
            out.append(TopLogprob(int(token_id), text, raw, float(logprob)))
        return tuple(out)
