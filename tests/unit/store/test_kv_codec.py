"""KV block encoding: fp16/bf16 round trips, header layout, corrupt and foreign values rejected."""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch

from services.store.kv_codec import BF16, FP16, decode_block, encode_block
from services.store.response_codec import CorruptEntry

SHAPE = (2, 2, 3, 4, 8)  # [layers, k/v, kv_heads, block_tokens, head_dim]


def test_numpy_fp16_round_trip_is_exact() -> None:
    a = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float16)
    data = encode_block(a)
    assert len(data) < a.nbytes + 64  # header is small, no pickle framing
    out = decode_block(data)
    assert out.dtype == np.float16 and out.shape == SHAPE and np.array_equal(out, a)
    assert not out.flags.writeable  # a zero-copy view of the value


def test_numpy_float32_is_stored_as_fp16() -> None:
    a = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    out = decode_block(encode_block(a))
    assert out.dtype == np.float16 and np.allclose(out, a, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_round_trip_keeps_dtype(dtype: torch.dtype) -> None:
    t = torch.randn(SHAPE, dtype=torch.float32).to(dtype)
    out = decode_block(encode_block(t), "torch")
    assert out.dtype == dtype and torch.equal(out, t)


def test_torch_float32_becomes_bf16_and_numpy_reads_bf16_as_float32() -> None:
    t = torch.randn(SHAPE) * 1e30  # outside fp16 range: bf16 keeps it
    data = encode_block(t)
    assert struct.unpack_from("<4sBB", data)[2] == BF16
    out = decode_block(data)
    assert out.dtype == np.float32 and np.array_equal(out, t.to(torch.bfloat16).float().numpy())


def test_header_layout() -> None:
    data = encode_block(np.zeros((3, 5), dtype=np.float16))
    assert struct.unpack_from("<4sBBBB2I", data) == (b"MSKV", 1, FP16, 2, 0, 3, 5)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:5],
        lambda b: b"MSKX" + b[4:],
        lambda b: b[:4] + bytes([2]) + b[5:],  # a future format version
        lambda b: b[:5] + bytes([7]) + b[6:],  # unknown dtype
        lambda b: b[:6] + bytes([0]) + b[7:],  # rank 0
        lambda b: b[:-2],  # truncated payload
        lambda b: b + b"\0\0",  # longer than its shape
        lambda b: b"\x80\x04\x95pickle" + b,
    ],
)
def test_corrupt_blocks_raise(mangle: Callable[[bytes], bytes]) -> None:
    data = encode_block(np.ones(SHAPE, dtype=np.float16))
    with pytest.raises(CorruptEntry):
        decode_block(mangle(data))


def test_rejects_integer_tensors() -> None:
    with pytest.raises(TypeError):
        encode_block(np.zeros(4, dtype=np.int32))
