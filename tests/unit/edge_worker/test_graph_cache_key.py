"""The load cache's key of the edited graph: int4_kernel=native gets its own entry (following the kernel's C sources
too), the default's key is unchanged."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from services.edge_worker.graph import _cache_key
from services.edge_worker.native import kernel as native_kernel


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


def test_the_native_key_follows_the_kernels_c_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"graph")
    source = tmp_path / "kq4.c"
    source.write_text("// the packed layout, version 1")
    monkeypatch.setattr(native_kernel, "SOURCES", (source,))
    options = ort.SessionOptions()
    before = _cache_key(model, "int8", options, "native")
    source.write_text("// the packed layout, version 2")  # e.g. the 8-bit layout: cached graphs must not be reused
    assert _cache_key(model, "int8", options, "native") != before
    assert _cache_key(model, "int8", options) == _cache_key(model, "int8", options, "mlas")
