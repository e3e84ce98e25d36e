"""Random-weight checkpoints (benchmarks/checkpoints.py): the parameter count and the stop tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.checkpoints import SHAPES, build_checkpoint, parameters
from services.common.model_paths import model_paths

TOKENIZER_DIR = model_paths().hf_dir


def test_the_360m_shape_counts_smollm2_360ms_parameters() -> None:
    assert parameters("360m") == 361_821_120  # SmolLM2-360M-Instruct, tied embeddings
    assert set(SHAPES) >= {"135m", "360m", "1b", "tiny"}


@pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(), reason="the default model is not prepared")
@pytest.mark.parametrize("stops", [False, True])
def test_a_built_checkpoint_has_the_counted_parameters_and_the_asked_stops(tmp_path: Path, stops: bool) -> None:
    out = build_checkpoint("tiny", TOKENIZER_DIR, tmp_path / "tiny", torch.device("cpu"), torch.float32, stops=stops)
    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        count = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert count == parameters("tiny", config["vocab_size"])
    expected = json.loads((TOKENIZER_DIR / "config.json").read_text())["eos_token_id"] if stops else None
    assert config.get("eos_token_id") == expected
    assert (out / "tokenizer.json").is_file()
