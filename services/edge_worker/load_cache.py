"""On-disk cache of the edge worker's edited decoder graph, so a restart skips rebuilding it.

Why: :func:`services.edge_worker.graph.load_session` edits the builder's graph at every start (the
int8 LM head: a 128-token calibration run to find its outlier channels, then the head's weights
dequantized and re-quantized). That is ~1.6 s of CPU on an idle machine (seconds more on a loaded
one), more than half of a restarted edge worker's start (docs/edge.md, *Startup*). The edit's product
is a serialized ONNX model (~30 MB: the new head's weights inline, every other weight still in the
model directory's external data file), written here once and handed to onnxruntime as it is on later
starts, so a cache hit builds the very same session (bit-identical logits, tested).

Key (:func:`graph_key`): a SHA-256 over everything the product depends on, so a stale entry is never
used: the graph file, the tokenizer and genai_config.json (hashed whole), the external data files
(by size and modification time: hashing their 227 MB would cost ~0.5-2 s, most of what the cache
saves; ``meshserve models prepare`` writes them anew), the source of the modules that make the edit,
the calibration text, the edit's settings, and the onnx, onnxruntime and numpy versions.

An entry is ``<key>.onnx`` with ``<key>.json`` ({"sha256", "bytes", "model_dir"}) written after it;
an entry whose bytes do not match is corrupt: it is removed and the graph rebuilt (never fatal).
Writing is atomic (a temporary file renamed), and a failed write (read-only or full disk) is
logged and skipped. A model directory keeps its ``KEEP`` newest entries (one per thread count, say);
older ones are removed when a new one is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

KEEP = 4
"""Entries kept per model directory (the newest)."""
WHOLE_FILE_LIMIT = 16 << 20
"""Files of the model directory up to this size are hashed whole; larger ones by size and mtime."""


def graph_key(
    model_path: Path, *, settings: dict[str, object], sources: Iterable[Path], versions: dict[str, str]
) -> str:
    """The cache key of ``model_path``'s edited graph (see the module docstring)."""
    digest = hashlib.sha256()

    def add(label: str, value: bytes) -> None:
        digest.update(f"{label}\0{len(value)}\0".encode())
        digest.update(value)

    add("settings", json.dumps(settings, sort_keys=True).encode())
    add("versions", json.dumps(versions, sort_keys=True).encode())
    for source in sources:
        add(f"source:{source.name}", source.read_bytes())
    for path in sorted(model_path.parent.iterdir()):
        if not path.is_file():
            continue
        stat = path.stat()
        if path == model_path or stat.st_size <= WHOLE_FILE_LIMIT:
            add(f"file:{path.name}", path.read_bytes())
        else:
            add(f"stat:{path.name}", f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


class GraphCache:
    """Entries ``<key>.onnx`` under ``directory`` (created on the first write)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None (missing, or corrupt: then it is removed)."""
        data_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            data = data_path.read_bytes()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._discard(key, f"unreadable: {exc}")
            return None
        if not isinstance(meta, dict) or meta.get("bytes") != len(data) or meta.get("sha256") != _sha256(data):
            self._discard(key, "its bytes do not match its digest")
            return None
        return data

    def put(self, key: str, data: bytes, model_dir: Path) -> None:
        """Store an entry (atomically); remove older entries of ``model_dir``. Errors are logged, not raised."""
        data_path, meta_path = self._paths(key)
        meta = {"sha256": _sha256(data), "bytes": len(data), "model_dir": str(model_dir)}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_atomic(data_path, data)
            _write_atomic(meta_path, json.dumps(meta).encode())  # last: an entry without it is not used
        except OSError as exc:
            log.warning("edge_graph_cache_not_written", directory=str(self.directory), error=str(exc))
            return
        same: list[tuple[float, str]] = []
        for other in self.directory.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                if json.loads(other.read_text()).get("model_dir") == str(model_dir):
                    same.append((other.stat().st_mtime, other.stem))
        for _, old in sorted(same, reverse=True)[KEEP:]:
            if old != key:
                self._remove(old)

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.onnx", self.directory / f"{key}.json"

    def _discard(self, key: str, why: str) -> None:
        log.warning("edge_graph_cache_corrupt", entry=str(self._paths(key)[0]), why=why, action="rebuilt")
        self._remove(key)

    def _remove(self, key: str) -> None:
        for path in self._paths(key):
            with contextlib.suppress(OSError):
                path.unlink()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
