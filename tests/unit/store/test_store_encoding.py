from __future__ import annotations

import struct

import pytest

from services.store.response_cache import ResponseCache
from services.store.response_codec import CachedResponse, CorruptEntry, Finish, decode_response, encode_response


def resp(tokens: tuple[int, ...] = (1, 2, 49151)) -> CachedResponse:
    return CachedResponse(tokens, "héllo ✓", Finish.LENGTH, prompt_tokens=7, completion_tokens=len(tokens))


@pytest.mark.parametrize("tokens", [(), (1, 2, 49151), (70000, 5)])
def test_round_trip(tokens: tuple[int, ...]) -> None:
    r = resp(tokens)
    assert decode_response(encode_response(r)) == r


def test_compact_width() -> None:
    assert len(encode_response(resp((1,) * 100))) < len(encode_response(resp((70000,) * 100)))


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:10],
        lambda b: b"XXXX" + b[4:],
        lambda b: b[:4] + bytes([99]) + b[5:],
        lambda b: b + b"x",
        lambda b: b[:5] + bytes([9]) + b[6:],  # unknown finish reason
        lambda b: b[:6] + bytes([3]) + b[7:],  # bad token width
        lambda b: b"\x80\x04pickle",
    ],
)
def test_corrupt_values_raise(mangle) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CorruptEntry):
        decode_response(mangle(encode_response(resp())))


def test_header_is_documented_layout() -> None:
    data = encode_response(resp((5, 6)))
    magic, version, finish, width = struct.unpack_from("<4sBBB", data)
    assert (magic, version, finish, width) == (b"MSRC", 1, 2, 2)


async def test_disabled_cache_is_a_miss() -> None:
    cache = ResponseCache.from_url("")
    assert not cache.enabled
    assert await cache.get("k") is None
    assert await cache.put("k", resp()) is False
