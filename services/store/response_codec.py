"""Value encodings of the response cache (no pickle; docs/cache.md has the byte layouts).

Response entry, format version 1::

    header  struct "<4sBBBBIIII": magic b"MSRC", format version, finish reason code, token width
            (2 or 4 bytes), reserved, token count, prompt tokens, completion tokens, text bytes
    tokens  token count x little-endian uint16/uint32
    text    UTF-8

A value with another magic, another version or inconsistent lengths raises :class:`CorruptEntry`;
readers count it and treat it as a miss, never trust it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache

MAGIC = b"MSRC"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBBBIIII")
_HEAD = _HEADER.size


class Finish(IntEnum):
    """Finish reasons a cached response may carry (same numbers as meshserve.v1.FinishReason)."""

    STOP = 1
    LENGTH = 2
    STOP_STRING = 3


_FINISH = {int(f): f for f in Finish}


class CorruptEntry(ValueError):
    """A cached value that is not a valid entry of a format this code knows."""


@dataclass(frozen=True)
class CachedResponse:
    """A finished response as the cache stores it."""

    token_ids: tuple[int, ...]
    text: str
    finish: Finish
    prompt_tokens: int
    completion_tokens: int


@lru_cache(maxsize=1024)
def _tokens(n: int, width: int) -> struct.Struct:
    """Struct of ``n`` little-endian uint16/uint32: packs and unpacks tuples in C, no array copy."""
    return struct.Struct(f"<{n}{'H' if width == 2 else 'I'}")


def _response(
    token_ids: tuple[int, ...], text: str, finish: Finish, prompt_tokens: int, completion_tokens: int
) -> CachedResponse:
    # A frozen dataclass's __init__ sets each field through object.__setattr__, which cost a third
    # of a decode; the values here were already checked, so fill the instance dict in one go.
    obj = object.__new__(CachedResponse)
    obj.__dict__.update(
        token_ids=token_ids, text=text, finish=finish, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
    )
    return obj


def encode_response(resp: CachedResponse) -> bytes:
    ids = resp.token_ids
    n = len(ids)
    try:
        width, tokens = 2, _tokens(n, 2).pack(*ids)
    except struct.error:  # an id >= 2**16 (or negative: then the uint32 pack says so)
        try:
            width, tokens = 4, _tokens(n, 4).pack(*ids)
        except struct.error as exc:
            raise ValueError(f"token ids must be in 0..2**32-1: {exc}") from None
    text = resp.text.encode()
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        int(resp.finish),
        width,
        0,
        n,
        resp.prompt_tokens,
        resp.completion_tokens,
        len(text),
    )
    return b"".join((header, tokens, text))


def decode_response(data: bytes) -> CachedResponse:
    """Parse a value written by :func:`encode_response`; raises :class:`CorruptEntry`."""
    if len(data) < _HEAD:
        raise CorruptEntry("value shorter than the header")
    magic, version, finish, width, _r, n, prompt, completion, text_len = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptEntry(f"unknown format {magic!r} v{version}")
    if width != 2 and width != 4:
        raise CorruptEntry(f"bad token width {width}")
    end_tokens = _HEAD + n * width
    if len(data) != end_tokens + text_len:
        raise CorruptEntry("length does not match the header")
    reason = _FINISH.get(finish)
    if reason is None:
        raise CorruptEntry(f"unknown finish reason {finish}")
    try:
        text = data[end_tokens:].decode()
    except UnicodeDecodeError as exc:
        raise CorruptEntry(str(exc)) from None
    return _response(_tokens(n, width).unpack_from(data, _HEAD), text, reason, prompt, completion)
