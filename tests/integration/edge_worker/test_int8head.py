"""The int8 LM head on the real INT4 model: close to the head as built, outlier channels found at load."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from services.common.model_paths import model_paths
from services.edge_worker.graph import load_session
from services.edge_worker.int8head import OUTLIER_CHANNELS, outlier_channels
from services.models.biascorrect import CALIBRATION_TEXT
from services.models.evaluate import HELDOUT

pytestmark = pytest.mark.integration
PROMPTS = ["Name three colours.", "What is the sea?", "Tell me a short story about a cat.", "Count to five."]


def _feeds(ids: list[int]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": np.array([ids], dtype=np.int64), "attention_mask": np.ones((1, len(ids)), dtype=np.int64)}
    for layer in range(30):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = np.zeros((1, 3, 0, 64), dtype=np.float32)
    return feeds


def test_int8_head_logits_stay_close_to_the_head_as_built() -> None:
    path = model_paths().edge_dir / "model.onnx"
    tokenizer = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    built = load_session(path, ort.SessionOptions(), lm_head="nbits")
    int8 = load_session(path, ort.SessionOptions(), lm_head="int8")
    for text in PROMPTS:
        ids = tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids
        (a,) = built.run(["logits"], _feeds(ids))
        (b,) = int8.run(["logits"], _feeds(ids))
        a, b = a[0, -1], b[0, -1]
        # measured: at most ~1.5 % of the logits' spread (0.3-0.5 of ~30-36)
        assert np.abs(a - b).max() < 0.05 * (a.max() - a.min())


def test_outlier_channels_do_not_depend_on_the_text() -> None:
    model_dir = model_paths().edge_dir
    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model_dir))
    head_size = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lear = outlier_channels(model, options, tokenizer.encode(CALIBRATION_TEXT.read_text()).ids[:128], head_size)
    tempest = outlier_channels(model, options, tokenizer.encode(HELDOUT.read_text()).ids[:128], head_size)
    assert len(lear) == OUTLIER_CHANNELS == len(set(lear.tolist()))
    # the largest channels are a property of the model; the last few places vary (14 of 16 shared, measured)
    assert len(set(lear.tolist()) & set(tempest.tolist())) >= OUTLIER_CHANNELS - 4
