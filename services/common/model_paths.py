"""Where `meshserve models prepare` puts each artifact (shared by prepare, workers and router).

Layout under the models directory (``$MESHSERVE_MODELS_DIR``, default ``~/.cache/meshserve/models``)::

    <models_dir>/smollm2-135m-instruct/hf/          HF checkpoint (safetensors, tokenizer, chat template)
    <models_dir>/smollm2-135m-instruct/edge-int4/   ONNX INT4 model for onnxruntime-genai
    <models_dir>/smollm2-135m-instruct/draft-int8/  ONNX INT8 build: the cloud tier's speculative draft
    <models_dir>/smollm2-135m-instruct/manifest.json  {"version": ..., "source": ...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.config import default_models_dir

DEFAULT_MODEL_ID = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelPaths:
    """Paths of one prepared model family."""

    root: Path

    @property
    def hf_dir(self) -> Path:
        return self.root / "hf"

    @property
    def edge_dir(self) -> Path:
        return self.root / "edge-int4"

    @property
    def draft_dir(self) -> Path:
        return self.root / "draft-int8"

    def default_draft(self) -> Path:
        """Speculative decoding's default draft: ``draft-int8`` when built, else the edge tier's ``edge-int4``."""
        return self.draft_dir if (self.draft_dir / "genai_config.json").is_file() else self.edge_dir

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    def version(self) -> str:
        """The prepared model's version (content hash written by prepare); "unprepared" if missing."""
        try:
            return str(json.loads(self.manifest.read_text())["version"])
        except (OSError, ValueError, KeyError):
            return "unprepared"


def model_paths(model_id: str = DEFAULT_MODEL_ID, models_dir: Path | None = None) -> ModelPaths:
    return ModelPaths((models_dir or default_models_dir()) / model_id)
