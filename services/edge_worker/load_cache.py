"""On-disk cache of the edge worker's edited decoder graph, so a restart or a wake skips rebuilding it.

Why: :func:`services.edge_worker.graph.load_session` edits the builder's graph at every start (the
int8 LM head: a 128-token calibration run to find its outlier channels, then the head's weights
dequantized and re-quantized; the native ops' packed weights). That is ~1.6 s of CPU on an idle
machine (seconds more on a loaded one), more than half of a restarted edge worker's start
(docs/edge.md, *Startup*). The edit's product is written here once and handed to onnxruntime as it is
on later loads, so a cache hit builds the very same session (bit-identical logits, tested).

An entry is three files:

- ``<key>.onnx``: the graph (~0.2 MB) with every initializer over :data:`INLINE_LIMIT` bytes stored
  as external data in
- ``<key>.data``: those weights (all of them, the model directory's too: onnxruntime takes one
  external data folder), each at an offset aligned to :data:`DATA_ALIGN`, so onnxruntime maps the
  file into memory instead of reading and copying it. A session build is then ~0.05 s of CPU
  instead of ~0.3 s (reading, checking and parsing the weights inline in the graph), which is what
  a wake costs (services/worker/sleep.py), and the weights are page-cache pages shared by every
  worker of the same model on the host rather than a private copy in each;
- ``<key>.json`` ({"sha256", "bytes", "data_bytes", "model_dir"}), written last.

Key (:func:`graph_key`): a SHA-256 over everything the product depends on, so a stale entry is never
used: the graph file, the tokenizer and genai_config.json (hashed whole), the external data files
(by size and modification time: hashing their 227 MB would cost ~0.5-2 s, most of what the cache
saves; ``meshserve models prepare`` writes them anew), the source of the modules that make the edit
and of this one (the entry's format), the calibration text, the edit's settings, and the onnx,
onnxruntime and numpy versions.

Checks (:meth:`GraphCache.get`, every load): the graph's digest and the data file's size (hashing its
234 MB would cost more than the whole session build it saves, at every wake; the key trusts the model
directory's own weights by size and modification time alike). Two workers that miss together write
the same bytes under the same key, so either's files serve both. An entry that fails
a check is corrupt: it is removed and the graph rebuilt (never fatal). Writing is atomic (each file
written whole under a temporary name, then renamed; never rewritten in place), and a failed write
(read-only or full disk) is logged and skipped. A model directory keeps its ``KEEP`` newest entries
(one per thread count, say); older ones are removed when a new one is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

KEEP = 4
"""Entries kept per model directory (the newest)."""
DATA_ALIGN = 1 << 16
"""Each weight's offset in ``<key>.data``: onnxruntime maps external data into memory when its offset
is a multiple of the allocation granularity (the page size here, 64 KiB on Windows)."""
INLINE_LIMIT = 1024
"""Initializers up to this many bytes stay inline in the graph (shapes, slice bounds, small biases)."""
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
    """Entries ``<key>.onnx`` + ``<key>.data`` under ``directory`` (created on the first write)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @staticmethod
    def data_name(key: str) -> str:
        """The entry's data file, relative to the directory (what the graph's external data names)."""
        return f"{key}.data"

    def get(self, key: str) -> bytes | None:
        """The entry's graph (its weights in :meth:`data_name`, in this directory), or None (missing, or
        corrupt: then it is removed)."""
        graph_path, data_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            graph = graph_path.read_bytes()
            stat = data_path.stat()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._discard(key, f"unreadable: {exc}")
            return None
        if not isinstance(meta, dict) or meta.get("bytes") != len(graph) or meta.get("sha256") != _sha256(graph):
            self._discard(key, "its graph does not match its digest")
            return None
        if meta.get("data_bytes") != stat.st_size:
            self._discard(key, "its data file is not the size it was written with")
            return None
        return graph

    def put(self, key: str, graph: bytes, weights: Sequence[tuple[int, bytes]], model_dir: Path) -> bool:
        """Store an entry (atomically): ``graph`` names :meth:`data_name` for its weights, ``weights`` are
        (offset, bytes) to write there. Removes older entries of ``model_dir``. False (logged, not
        raised) when it cannot be written."""
        graph_path, data_path, meta_path = self._paths(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_atomic(data_path, weights)
            _write_atomic(graph_path, [(0, graph)])
            meta = {
                "sha256": _sha256(graph),
                "bytes": len(graph),
                "data_bytes": max((offset + len(data) for offset, data in weights), default=0),
                "model_dir": str(model_dir),
            }
            _write_atomic(meta_path, [(0, json.dumps(meta).encode())])  # last: an entry without it is not used
        except OSError as exc:
            log.warning("edge_graph_cache_not_written", directory=str(self.directory), error=str(exc))
            return False
        same: list[tuple[float, str]] = []
        for other in self.directory.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                if json.loads(other.read_text()).get("model_dir") == str(model_dir):
                    same.append((other.stat().st_mtime, other.stem))
        for _, old in sorted(same, reverse=True)[KEEP:]:
            if old != key:
                self._remove(old)
        return True

    def _paths(self, key: str) -> tuple[Path, Path, Path]:
        return self.directory / f"{key}.onnx", self.directory / self.data_name(key), self.directory / f"{key}.json"

    def _discard(self, key: str, why: str) -> None:
        log.warning("edge_graph_cache_corrupt", entry=str(self._paths(key)[0]), why=why, action="rebuilt")
        self._remove(key)

    def _remove(self, key: str) -> None:
        for path in self._paths(key):
            with contextlib.suppress(OSError):
                path.unlink()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, chunks: Sequence[tuple[int, bytes]]) -> None:
    """Write ``chunks`` ((offset, bytes), in order; zeros between them) to ``path`` through a renamed
    temporary file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for offset, data in chunks:
                if offset < size:
                    raise ValueError(f"chunk at {offset} overlaps the {size} bytes before it")
                out.write(bytes(offset - size))
                out.write(data)
                size = offset + len(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
