"""`models prepare` logic with fake builders: adoption, skipping, atomic rebuilds, sources, versions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from services.models import prepare as prep
from services.models.quantize import Int4Options
from services.models.sources import GGUF_FILE, PrepareError, Source, default_model_id, default_source, resolve_source

SOURCE = Source("gguf", f"/nowhere/{GGUF_FILE}", "test:source")


def write_hf(path: Path, value: float = 1.0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "model_type": "llama"}))
    (path / "tokenizer.json").write_text("{}")
    save_file({"w": np.full((4, 4), value, dtype=np.float32)}, str(path / "model.safetensors"))


def write_edge(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "model.onnx"}}}))
    (path / "model.onnx").write_bytes(b"graph")
    (path / "model.onnx.data").write_bytes(b"weights")
    (path / "tokenizer.json").write_text("{}")


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the real builders by fakes that record what was built."""
    done: list[str] = []

    def fake_hf(source: Source, dest: Path, show_progress: bool = True) -> None:
        done.append("hf")
        write_hf(dest, value=float(len(done)))

    def fake_edge(
        hf_dir: Path, dest: Path, log_path: Path, show_progress: bool = True, int4: Int4Options | None = None
    ) -> None:
        assert prep.hf_complete(hf_dir)
        done.append("edge")
        write_edge(dest)

    monkeypatch.setattr(prep, "build_hf", fake_hf)
    monkeypatch.setattr(prep, "build_edge", fake_edge)
    return done


def run(
    tmp_path: Path, source: Source = SOURCE, force: bool = False, int4: Int4Options | None = None
) -> prep.PrepareResult:
    return prep.prepare(DEFAULT_MODEL_ID, tmp_path, source, force=force, show_progress=False, int4=int4)


def test_changed_int4_options_rebuild_only_the_edge_model_and_change_the_version(
    tmp_path: Path, builds: list[str]
) -> None:
    first = run(tmp_path)
    manifest = json.loads(first.paths.manifest.read_text())
    assert manifest["edge_int4"] == Int4Options().as_dict() and manifest["format"] == 2
    other = Int4Options(block_size=64, symmetric=True, accuracy_level=1, lm_head="fp32")
    second = run(tmp_path, int4=other)
    assert builds == ["hf", "edge", "edge"] and second.version != first.version
    assert run(tmp_path, int4=other).built == []
    # A manifest written before the options were recorded (format 1) rebuilds the edge model.
    old = json.loads(second.paths.manifest.read_text())
    del old["edge_int4"]
    second.paths.manifest.write_text(json.dumps(old))
    assert run(tmp_path, int4=other).built == ["edge", "manifest"]


def test_int4_options_map_to_builder_extra_options() -> None:
    default = Int4Options().extra_options()
    assert "is_symmetric=false" in default and "block_size=32" in default and "shared_embeddings=false" in default
    assert "matmul_mixed_precision=last_matmul:int8,mixed_layers:int8" in default
    plain = Int4Options(sensitive_int8=False).extra_options()
    assert "matmul_mixed_precision=last_matmul:int8" in plain
    fp_head = Int4Options(lm_head="fp32", embeddings="int4", accuracy_level=1).extra_options()
    assert "nodes_to_exclude=/lm_head/MatMul" in fp_head and "op_types_to_quantize=MatMul/Gather" in fp_head
    assert "accuracy_level=1" in fp_head
    with pytest.raises(ValueError, match="block size"):
        Int4Options(block_size=48)


def test_complete_outputs_without_manifest_are_adopted(tmp_path: Path, builds: list[str]) -> None:
    paths = model_paths(DEFAULT_MODEL_ID, tmp_path)
    write_hf(paths.hf_dir)
    write_edge(paths.edge_dir)
    first = run(tmp_path)
    assert builds == [] and first.built == ["manifest"]
    manifest = json.loads(paths.manifest.read_text())
    assert manifest["source"] == "test:source" and len(manifest["version"]) == 12
    assert set(manifest["files"]) == {"hf/model.safetensors", "edge-int4/model.onnx", "edge-int4/model.onnx.data"}
    assert paths.version() == first.version
    again = run(tmp_path)
    assert again.built == [] and again.skipped == ["hf", "edge", "manifest"] and again.version == first.version


def test_fresh_build_then_skip(tmp_path: Path, builds: list[str]) -> None:
    first = run(tmp_path)
    assert builds == ["hf", "edge"] and first.built == ["hf", "edge", "manifest"]
    assert run(tmp_path).built == [] and builds == ["hf", "edge"]
    assert not list(first.paths.root.glob(".*.partial"))


def test_truncated_weights_rebuild_both_dirs(tmp_path: Path, builds: list[str]) -> None:
    first = run(tmp_path)
    weights = first.paths.hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    second = run(tmp_path)
    assert builds == ["hf", "edge", "hf", "edge"]
    assert second.version != first.version, "different weights give a different version"


def test_missing_edge_rebuilds_only_edge(tmp_path: Path, builds: list[str]) -> None:
    first = run(tmp_path)
    (first.paths.edge_dir / "genai_config.json").unlink()
    run(tmp_path)
    assert builds == ["hf", "edge", "edge"]


def test_force_and_source_change_rebuild(tmp_path: Path, builds: list[str]) -> None:
    run(tmp_path)
    run(tmp_path, force=True)
    assert builds == ["hf", "edge"] * 2
    other = run(tmp_path, Source("hf_dir", "/else", "hf-dir:/else"))
    assert builds == ["hf", "edge"] * 3
    assert json.loads(other.paths.manifest.read_text())["source"] == "hf-dir:/else"


def test_interrupted_build_leaves_previous_model_and_no_partial_dir(
    tmp_path: Path, builds: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = run(tmp_path)

    def crash(source: Source, dest: Path, show_progress: bool = True) -> None:
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "build_hf", crash)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, force=True)
    assert prep.hf_complete(first.paths.hf_dir), "the previous complete model is untouched"
    assert not list(first.paths.root.glob(".*.partial"))
    assert first.paths.version() == "unprepared", "a half-done rebuild is not advertised as prepared"


def test_checks_reject_incomplete_dirs(tmp_path: Path) -> None:
    assert not prep.hf_complete(tmp_path / "missing")
    write_hf(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").unlink()
    assert not prep.hf_complete(tmp_path / "hf")
    write_edge(tmp_path / "edge")
    (tmp_path / "edge" / "model.onnx.data").write_bytes(b"")
    assert not prep.edge_complete(tmp_path / "edge")


def test_resolve_sources(tmp_path: Path) -> None:
    default = resolve_source(None)
    assert default == default_source() and default.kind == "gguf" and Path(default.location).is_file()
    assert default_model_id(default) == DEFAULT_MODEL_ID
    write_hf(tmp_path / "My_Model")
    local = resolve_source(str(tmp_path / "My_Model"))
    assert local.kind == "hf_dir" and default_model_id(local) == "my-model"
    assert local.load_kwargs()[1] == {"local_files_only": True}
    hub = resolve_source("hub:org/name")
    assert hub.kind == "hub" and hub.location == "org/name"
    with pytest.raises(PrepareError, match="hub:org/name"):
        resolve_source("org/name")  # a bare hub id is never downloaded implicitly
    with pytest.raises(PrepareError, match="hub:org/name"):
        resolve_source("hub:not a hub id")


def test_cli_reports_errors_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    assert main(["models", "prepare", "--source", "/does/not/exist", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a .gguf file nor an HF checkpoint dir" in err
