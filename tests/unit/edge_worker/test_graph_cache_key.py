"""The load cache's key of the edited graph: int4_kernel=native gets its own entry, the default's key is unchanged."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from services.edge_worker.graph import _cache_key


def test_native_has_its_own_key_and_mlas_keeps_the_old_one(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"graph")
    (tmp_path / "tokenizer.json").write_text("{}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    default = _cache_key(model, "int8", options)
    assert _cache_key(model, "int8", options, "mlas") == default
    native = _cache_key(model, "int8", options, "native")
    assert native != default
    options.intra_op_num_threads = 1  # the native op's threads are baked into the graph
    assert _cache_key(model, "int8", options, "native") not in (native, _cache_key(model, "int8", options))
