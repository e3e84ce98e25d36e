"""On-disk copy of the cloud model's fused weights (q/k/v, gate/up), mapped instead of built at start.

Why: the forward runs one matmul over q, k and v and one over gate and up (model.py), so every start
concatenated 60 weight pairs and triples into ~280 MB of fresh memory: ~1 s of CPU on an idle 2-core
host and ~4 s on a loaded one (page faults and copies), the largest part of a restarted cloud worker's
model load (docs/cloud.md, *Startup*). Written once as a safetensors file, they are mapped from the
page cache on later starts like the checkpoint itself (~0.05 s).

A cached tensor is used only if it equals the concatenation it stands for, compared part by part
against the checkpoint (:func:`fused`: reads both with memcmp, allocates nothing), so a stale or corrupt file can
never change the model: it is rebuilt and written again. The file's name (:func:`cache_key`) keys
the checkpoint files (by name, size and modification time), the config, the shard and the dtype, so
the comparison normally confirms, and other models or shards get their own files. Writing is atomic
(a temporary file renamed); a failed write (read-only or full disk) is logged and the worker serves.
A directory keeps the ``KEEP`` newest files. As with the mapped checkpoint itself, a file must not be
changed in place while a worker maps it (the kernel would fault its reads): replace it, as this does.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog
import torch
from torch import Tensor

log = structlog.get_logger(__name__)

KEEP = 4
"""Files kept in the cache directory (the newest): one per tensor-parallel rank, say."""


def cache_key(checkpoint: Sequence[Path], identity: Mapping[str, object]) -> str:
    """The file name's key: ``checkpoint`` files by name, size and mtime, ``identity`` (config, shard,
    dtype: JSON), and the torch version."""
    files = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in checkpoint]
    parts = {"files": files, "identity": identity, "torch": torch.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def read(path: Path) -> dict[str, Tensor] | None:
    """The cached tensors (mapped, not read), or None when there are none or the file is unreadable."""
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # truncated, not safetensors: rebuilt from the checkpoint
        log.warning("cloud_weights_cache_unreadable", path=str(path), error=str(exc), action="rebuilt")
        return None


def fused(name: str, parts: Sequence[Tensor], cached: Mapping[str, Tensor] | None) -> tuple[Tensor, bool]:
    """``cat(parts)`` (dim 0), or ``cached[name]`` when it equals that; the flag says it was built."""
    hit = cached.get(name) if cached is not None else None
    rows = sum(p.shape[0] for p in parts)
    if hit is not None and hit.dtype == parts[0].dtype and hit.device == parts[0].device:
        if tuple(hit.shape) == (rows, *parts[0].shape[1:]):
            offset = 0
            for part in parts:
                if not _equal(hit[offset : offset + part.shape[0]], part):
                    break
                offset += part.shape[0]
            else:
                return hit, False
    return torch.cat(tuple(parts)).contiguous(), True


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def _equal(a: Tensor, b: Tensor) -> bool:
    """Bytewise equality: libc's memcmp over contiguous CPU tensors (``torch.equal`` builds a bool tensor
    of the size of its inputs first: 2.5 s instead of ~0.1 s for SmolLM2-135M's weights on a loaded host)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device.type != "cpu" or not (a.is_contiguous() and b.is_contiguous()):
        return torch.equal(a, b)
    return _memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0


def write(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """Store ``tensors`` at ``path`` (atomically); remove older files beyond ``KEEP``. Errors are logged."""
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, RuntimeError) as exc:
        log.warning("cloud_weights_cache_not_written", path=str(path), error=str(exc))
        return
    files = sorted(path.parent.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[KEEP:]:
        if old != path:
            with contextlib.suppress(OSError):
                old.unlink()
