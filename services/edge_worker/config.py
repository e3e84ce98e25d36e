"""Edge worker settings (env prefix ``MESHSERVE_EDGE_WORKER_``, YAML section ``edge_worker:``)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import model_validator
from pydantic_settings import SettingsConfigDict

from services.common.errors import ConfigError
from services.common.worker.settings import WorkerSettings
from services.models.paths import model_paths


class EdgeWorkerSettings(WorkerSettings):
    """Settings of one edge worker replica."""

    service: ClassVar[str] = "edge_worker"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_EDGE_WORKER_", extra="ignore")

    model_dir: Path | None = None
    """onnxruntime-genai model directory (genai_config.json, model.onnx, tokenizer.json); empty uses
    `<models_dir>/<model_id>/edge-int4` from `meshserve models prepare`."""

    @model_validator(mode="after")
    def _check_model_dir(self) -> EdgeWorkerSettings:
        if not (self.resolved_model_dir() / "genai_config.json").is_file():
            raise ConfigError(
                f"no onnxruntime-genai model at {self.resolved_model_dir()}; run `meshserve models prepare` "
                "or set MESHSERVE_EDGE_WORKER_MODEL_DIR to a directory with genai_config.json"
            )
        return self

    def resolved_model_dir(self) -> Path:
        return self.model_dir or model_paths(self.model_id).edge_dir
