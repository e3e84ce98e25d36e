"""Cloud (GPU) worker settings (env prefix ``MESHSERVE_GPU_WORKER_``, YAML section ``gpu_worker:``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import model_validator
from pydantic_settings import SettingsConfigDict

from services.common.errors import ConfigError
from services.common.worker.settings import WorkerSettings
from services.models.paths import model_paths


class GpuWorkerSettings(WorkerSettings):
    """Settings of one cloud worker replica."""

    service: ClassVar[str] = "gpu_worker"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_GPU_WORKER_", extra="ignore")

    model: str = ""
    """HF checkpoint directory or hub id; empty uses `<models_dir>/<model_id>/hf` from `meshserve models prepare`."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs: cuda when available (auto), or forced cpu/cuda."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weights/activations dtype; auto is float32 on CPU, bfloat16 on CUDA (float16 where bf16 is unsupported)."""

    @model_validator(mode="after")
    def _check_dtype(self) -> GpuWorkerSettings:
        if self.device == "cpu" and self.dtype == "float16":
            raise ConfigError(
                "float16 is slow and inaccurate on CPU; set MESHSERVE_GPU_WORKER_DTYPE to float32 or auto"
            )
        return self

    def resolved_model(self) -> str:
        return self.model or str(model_paths(self.model_id).hf_dir)

    def check_model(self) -> str:
        """The checkpoint to load, or ConfigError saying how to get one (checked when the worker starts)."""
        if not self.model and not (model_paths(self.model_id).hf_dir / "config.json").is_file():
            raise ConfigError(
                f"no HF checkpoint at {model_paths(self.model_id).hf_dir}; run `meshserve models prepare` "
                "or set MESHSERVE_GPU_WORKER_MODEL to a checkpoint directory or hub id"
            )
        return self.resolved_model()
