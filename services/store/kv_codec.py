"""Encoding of one KV prefix block: a small versioned header + raw fp16/bf16 bytes (no pickle).

A block is one tensor, typically shaped ``[layers, 2, kv_heads, block_tokens, head_dim]``. Layout,
format version 1::

    header  struct "<4sBBBB": magic b"MSKV", format version, dtype code (1 fp16, 2 bf16),
            number of dimensions (1..8), reserved
    shape   ndim x little-endian uint32
    payload the elements, C order, little-endian (exactly 2 x prod(shape) bytes)

No checksum: Redis writes a value atomically, and the magic/version/dtype/rank/exact-length checks
already reject foreign, old-format and truncated values; a CRC32 cost ~15 % of a block transfer
here (docs/benchmarks/cache.md). Encoding makes exactly one copy of the tensor's bytes; decoding to
numpy fp16 makes none (the array is a read-only view of the value).

numpy arrays are accepted as float16 (or float32/float64, stored as float16); torch tensors as
float16 or bfloat16 (float32 is stored as bfloat16, keeping its range). Decoding returns the same
kind of object the caller asks for. torch is imported only when a torch tensor is involved, so the
router does not pay its import time.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from services.store.response_codec import CorruptEntry

if TYPE_CHECKING:
    import torch

MAGIC = b"MSKV"
FORMAT_VERSION = 1
FP16, BF16 = 1, 2
_HEADER = struct.Struct("<4sBBBB")
_MAX_DIMS = 8
_ITEM = 2

Tensor = Any  # np.ndarray | torch.Tensor


def _is_torch(t: object) -> bool:
    return type(t).__module__.split(".", 1)[0] == "torch"


def _elements(t: Tensor) -> tuple[int, tuple[int, ...], np.ndarray]:
    """(dtype code, shape, C-contiguous little-endian 2-byte elements), copying only if needed."""
    if _is_torch(t):
        import torch

        tt: torch.Tensor = t.detach()
        if tt.dtype == torch.float16:
            code = FP16
        else:
            code = BF16
            if tt.dtype != torch.bfloat16:
                tt = tt.to(torch.bfloat16)
        raw = tt.contiguous().cpu().view(torch.int16).numpy()
        return code, tuple(tt.shape), np.ascontiguousarray(raw, dtype="<i2")
    arr = np.asarray(t)
    if arr.dtype.kind != "f":
        raise TypeError(f"a KV block must be a float tensor, got {arr.dtype}")
    return FP16, arr.shape, np.ascontiguousarray(arr, dtype="<f2")


def encode_block_view(t: Tensor) -> memoryview:
    """Encode one block tensor (numpy array or torch tensor) into a fresh buffer (one copy)."""
    code, shape, elements = _elements(t)
    if not 1 <= len(shape) <= _MAX_DIMS:
        raise ValueError(f"a KV block must have 1 to {_MAX_DIMS} dimensions, got {len(shape)}")
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, code, len(shape), 0) + struct.pack(f"<{len(shape)}I", *shape)
    # One allocation and one copy (a bytearray would be zero-filled first, then copied into).
    return memoryview(b"".join((head, elements.reshape(-1).view(np.uint8).data)))


def encode_block(t: Tensor) -> bytes:
    """Like :func:`encode_block_view`, as bytes."""
    return bytes(encode_block_view(t))


def decode_block(data: bytes, as_: Literal["numpy", "torch"] = "numpy") -> Tensor:
    """Decode a value of :func:`encode_block`; raises :class:`CorruptEntry` on anything else.

    ``as_="numpy"`` gives read-only float16 views of ``data`` (bf16 blocks come back as float32
    copies, numpy has no bf16);
    ``as_="torch"`` gives tensors of the stored dtype.
    """
    if len(data) < _HEADER.size:
        raise CorruptEntry("value shorter than the header")
    magic, version, code, ndim, _r = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptEntry(f"unknown format {magic!r} v{version}")
    if code not in (FP16, BF16) or not 1 <= ndim <= _MAX_DIMS:
        raise CorruptEntry(f"bad dtype code {code} or rank {ndim}")
    off = _HEADER.size + 4 * ndim
    if len(data) < off:
        raise CorruptEntry("value shorter than its shape")
    shape = struct.unpack_from(f"<{ndim}I", data, _HEADER.size)
    if len(data) - off != _ITEM * math.prod(shape):
        raise CorruptEntry("payload length does not match the shape")
    raw = np.frombuffer(data, dtype="<f2" if code == FP16 else "<u2", offset=off).reshape(shape)
    if as_ == "torch":
        import torch

        if sys.byteorder != "little":  # pragma: no cover
            raw = raw.byteswap()
        t = torch.from_numpy(raw.view(np.int16).copy()).view(torch.float16 if code == FP16 else torch.bfloat16)
        return t
    if code == FP16:
        return raw
    return (raw.astype(np.uint32) << 16).view(np.float32)
