"""The edge worker's graph cache (load_cache.py) on the real INT4 model: a hit gives bit-identical
logits, a corrupt entry is rebuilt, a changed input is a miss, the weights are mapped from the entry."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from services.common.model_paths import model_paths
from services.edge_worker.graph import _cache_key, load_session
from services.edge_worker.load_cache import DATA_ALIGN, INLINE_LIMIT, WHOLE_FILE_LIMIT, GraphCache

pytestmark = pytest.mark.integration
TEXT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


def _feeds(ids: list[int]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": np.array([ids], dtype=np.int64), "attention_mask": np.ones((1, len(ids)), dtype=np.int64)}
    for layer in range(30):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = np.zeros((1, 3, 0, 64), dtype=np.float32)
    return feeds


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return options


def _logits(session: ort.InferenceSession) -> np.ndarray:
    ids = Tokenizer.from_file(str(model_paths().edge_dir / "tokenizer.json")).encode(TEXT).ids
    (logits,) = session.run(["logits"], _feeds(ids))
    return np.asarray(logits)


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.onnx"))


def test_a_cache_hit_gives_bit_identical_logits_and_a_corrupt_entry_is_rebuilt(tmp_path: Path) -> None:
    path = model_paths().edge_dir / "model.onnx"
    uncached = _logits(load_session(path, _options(), lm_head="int8"))
    first = _logits(load_session(path, _options(), lm_head="int8", cache_dir=tmp_path))  # miss: built, written
    (entry,) = _entries(tmp_path)
    written = entry.stat().st_mtime_ns
    hit = _logits(load_session(path, _options(), lm_head="int8", cache_dir=tmp_path))
    assert entry.stat().st_mtime_ns == written  # used, not rewritten
    assert np.array_equal(first, uncached) and np.array_equal(hit, uncached)

    graph = bytearray(entry.read_bytes())
    graph[len(graph) // 2] ^= 0xFF  # one flipped byte in the graph
    entry.write_bytes(bytes(graph))
    rebuilt = _logits(load_session(path, _options(), lm_head="int8", cache_dir=tmp_path))
    assert np.array_equal(rebuilt, uncached)
    assert GraphCache(tmp_path).get(entry.stem) is not None  # written again, whole

    entry.write_bytes(b"")  # truncated to nothing
    assert np.array_equal(_logits(load_session(path, _options(), lm_head="int8", cache_dir=tmp_path)), uncached)

    data = tmp_path / GraphCache.data_name(entry.stem)
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size - DATA_ALIGN)  # a data file cut short (its weights past the end)
    assert GraphCache(tmp_path).get(entry.stem) is None  # corrupt: removed
    assert not data.exists()
    assert np.array_equal(_logits(load_session(path, _options(), lm_head="int8", cache_dir=tmp_path)), uncached)


def test_an_entry_keeps_its_weights_aligned_in_a_data_file_that_sessions_map(tmp_path: Path) -> None:
    """The graph holds no weight over INLINE_LIMIT bytes; each is at a DATA_ALIGN offset of the entry's
    data file, so onnxruntime maps it instead of copying it: a session built from the entry grows the
    process's anonymous memory by far less than the weights' size."""
    path = model_paths().edge_dir / "model.onnx"
    load_session(path, _options(), lm_head="int8", cache_dir=tmp_path)  # miss: built, written
    (entry,) = _entries(tmp_path)
    graph = onnx.load(str(entry), load_external_data=False)
    data = tmp_path / GraphCache.data_name(entry.stem)
    external = [init for init in graph.graph.initializer if init.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) > 100
    for init in external:
        fields = {item.key: item.value for item in init.external_data}
        assert fields["location"] == data.name and int(fields["offset"]) % DATA_ALIGN == 0
    inline = [init for init in graph.graph.initializer if init.data_location != onnx.TensorProto.EXTERNAL]
    assert all(len(init.raw_data) <= INLINE_LIMIT for init in inline)

    before = _anonymous_bytes()
    session = load_session(path, _options(), lm_head="int8", cache_dir=tmp_path)  # hit
    assert _anonymous_bytes() - before < data.stat().st_size // 2
    assert _logits(session).shape[-1] == 49152


def _anonymous_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_the_key_changes_with_what_the_graph_depends_on(tmp_path: Path) -> None:
    model_dir = tmp_path / "edge-int4"  # a stand-in: only the files' bytes and stats enter the key
    model_dir.mkdir()
    path = model_dir / "model.onnx"
    path.write_bytes(b"graph")
    (model_dir / "tokenizer.json").write_text("{}")
    data = model_dir / "model.onnx.data"
    with data.open("wb") as f:
        f.truncate(WHOLE_FILE_LIMIT + 1)  # sparse: keyed by size and mtime
    key = _cache_key(path, "int8", _options())
    assert _cache_key(path, "int8", _options()) == key
    assert _cache_key(path, "nbits", _options()) != key
    one_thread = ort.SessionOptions()
    one_thread.intra_op_num_threads = 1
    assert _cache_key(path, "int8", one_thread) != key
    (model_dir / "tokenizer.json").write_text("{ }")
    assert _cache_key(path, "int8", _options()) != key
    (model_dir / "tokenizer.json").write_text("{}")
    assert _cache_key(path, "int8", _options()) == key
    path.write_bytes(b"graph2")
    assert _cache_key(path, "int8", _options()) != key
    path.write_bytes(b"graph")
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the weights written anew
    assert _cache_key(path, "int8", _options()) != key


def test_an_unwritable_cache_directory_is_not_fatal(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    path = model_paths().edge_dir / "model.onnx"
    session = load_session(path, _options(), lm_head="nbits", cache_dir=blocked / "cache")
    assert _logits(session).shape[-1] == 49152
