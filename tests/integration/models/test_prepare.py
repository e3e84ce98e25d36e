"""The real `meshserve models prepare` into a fresh models dir (GGUF -> safetensors -> ONNX INT4, INT8 draft)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.models import draft
from services.models import prepare as prep

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)  # two builder runs plus bias-correction calibration (~1 min of CPU) on a loaded CI box
def test_full_build_from_the_default_gguf_then_idempotent(tmp_path: Path) -> None:
    result = prep.prepare(models_dir=tmp_path, show_progress=False)
    paths = result.paths
    assert result.built == ["hf", "edge", "manifest"]
    assert prep.hf_complete(paths.hf_dir) and prep.edge_complete(paths.edge_dir)
    assert (paths.hf_dir / "chat_template.jinja").is_file(), "the router applies this template for Chat"
    config = json.loads((paths.hf_dir / "config.json").read_text())
    assert "quantization_config" not in config, "the saved checkpoint is plain safetensors"
    assert "Reading layer" in (paths.root / "edge-build.log").read_text()
    assert not list(paths.root.glob(".*.partial")) and not list(paths.root.glob(".*builder-cache"))
    assert paths.version() == result.version and len(result.version) == 12

    again = prep.prepare(models_dir=tmp_path, show_progress=False)
    assert again.built == [] and again.version == result.version

    assert draft.prepare_draft(paths, show_progress=False), "the INT8 draft is built from hf/"
    assert draft.draft_complete(paths) and paths.default_draft() == paths.draft_dir
    assert "-p int8" in (paths.root / "draft-build.log").read_text()
    assert not draft.prepare_draft(paths, show_progress=False), "and skipped once complete"
    assert not list(paths.root.glob(".*.partial")) and not list(paths.root.glob(".*builder-cache"))

    import onnxruntime_genai as og

    for model_dir in (paths.edge_dir, paths.draft_dir):
        _generate_four_tokens(og, model_dir)


def _generate_four_tokens(og: Any, model_dir: Path) -> None:
    model = og.Model(str(model_dir))
    tokenizer = og.Tokenizer(model)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=16, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(tokenizer.encode("The capital of France is"))
    steps = 0
    while not generator.is_done() and steps < 4:
        generator.generate_next_token()
        steps += 1
    assert steps == 4, model_dir
