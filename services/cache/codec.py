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
import sys
from array import array
from dataclasses import dataclass
from enum import IntEnum

MAGIC = b"MSRC"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBBBIIII")
_LITTLE = sys.byteorder == "little"


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


def encode_response(resp: CachedResponse) -> bytes:
    ids = resp.token_ids
    width = 2 if not ids or (min(ids) >= 0 and max(ids) < 1 << 16) else 4  # min/max in C, not a genexpr
    tokens = array("H" if width == 2 else "I", ids)
    if tokens.itemsize != width:  # platforms where "I" is not 4 bytes
        raise ValueError("unsupported platform integer size")
    if not _LITTLE:
        tokens.byteswap()
    text = resp.text.encode()
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        int(resp.finish),
        width,
        0,
        len(tokens),
        resp.prompt_tokens,
        resp.completion_tokens,
        len(text),
    )
    return header + tokens.tobytes() + text


def decode_response(data: bytes) -> CachedResponse:
    """Parse a value written by :func:`encode_response`; raises :class:`CorruptEntry`."""
    if len(data) < _HEADER.size:
        raise CorruptEntry("value shorter than the header")
    magic, version, finish, width, _r, n, prompt, completion, text_len = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptEntry(f"unknown format {magic!r} v{version}")
    if width not in (2, 4):
        raise CorruptEntry(f"bad token width {width}")
    end_tokens = _HEADER.size + n * width
    if len(data) != end_tokens + text_len:
        raise CorruptEntry("length does not match the header")
    reason = _FINISH.get(finish)
    if reason is None:
        raise CorruptEntry(f"unknown finish reason {finish}")
    try:
        text = data[end_tokens:].decode()
    except UnicodeDecodeError as exc:
        raise CorruptEntry(str(exc)) from None
    tokens = array("H" if width == 2 else "I")
    tokens.frombytes(data[_HEADER.size : end_tokens])
    if not _LITTLE:
        tokens.byteswap()
    return CachedResponse(tuple(tokens), text, reason, prompt, completion)
