"""Cloud (GPU) worker settings (env prefix ``MESHSERVE_GPU_WORKER_``, YAML section ``gpu_worker:``)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.config import default_load_cache_dir
from services.common.errors import ConfigError
from services.common.model_paths import model_paths
from services.worker.config import WorkerSettings


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
    allow_download: bool = False
    """Let a hub id in ``model`` be downloaded when it is not in the local HF cache (off: offline only)."""
    load_cache: bool = True
    """CPU: keep the fused q/k/v and gate/up weights (~280 MB for SmolLM2-135M) in ``load_cache_dir`` and
    map them on later starts instead of concatenating them again (~1-4 s); a cached tensor is used only
    if it equals what it stands for (docs/cloud.md, *Startup*)."""
    load_cache_dir: Path | None = None
    """Where ``load_cache`` keeps them; empty uses the user's cache,
    `~/.cache/meshserve/load-cache/cloud` (whatever the models directory is)."""
    max_active_sequences: int = Field(default=32, ge=1, le=256)
    """Sequences generating at once (one continuous batch); more wait in the queue."""
    kv_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """KV cache dtype; auto is the model dtype when 16-bit, else float16 (half the memory, stored exactly in Redis)."""
    cpu_primitive_cache: int = Field(default=128, ge=0)
    """CPU: most oneDNN primitives (kernels built for one matmul shape) the process keeps, oneDNN's
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, which this sets for the process (oneDNN's own default is 1024).
    Prefill steps of every new token count add entries, so at 1024 the cache grew the worker's heap
    by ~220 MB over minutes (docs/cloud.md, *Memory*); a miss costs ~0.2 ms per kernel built."""
    kv_budget_bytes: int = Field(default=512 << 20, ge=1 << 20)
    """KV cache memory (live sequences + cached prefixes); a request that cannot fit waits for space.
    KV blocks hold ``prefix_block_tokens`` tokens (the block size of the Redis prefix cache and the router)."""
    max_step_tokens: int = Field(default=512, ge=16)
    """Tokens one batch step may process: every decoding sequence's token, then prefill chunks up to this."""
    decode_graphs: Literal["auto", "on", "off"] = "auto"
    """Pure decode steps with static shapes (batch buckets, fixed-width block tables, sampling on the device),
    captured as CUDA graphs on a GPU (docs/cloud.md "Static decode steps"): auto is on for CUDA and off on
    CPU; on runs the same static-shape step on CPU without capture; off keeps the eager step everywhere.
    Off under tensor parallelism. Needs one KV block of the budget for padding rows."""
    prefix_cache: bool = True
    """Reuse KV of prompt prefixes computed earlier (local LRU, and Redis when ``redis_url`` is set)."""
    redis_url: str = ""
    """Redis of the shared KV prefix cache (exports finished prefixes, imports on local miss); empty: local only."""
    kv_redis_budget_bytes: int = Field(default=256 << 20, ge=1 << 20)
    """Most KV bytes one scope (model version x tenant) may hold in Redis."""
    kv_redis_ttl_s: int = Field(default=3600, ge=1)
    """Lifetime of a KV block in Redis."""
    kv_redis_timeout_s: float = Field(default=0.5, gt=0)
    """Deadline of one Redis KV transfer; slower is a miss."""
    tp_timeout_s: float = Field(default=120.0, gt=0)
    """Tensor parallelism (torchrun ranks > 1): timeout of one collective; an idle rank 0 pings a third as often."""
    speculative: bool = False
    """Speculative decoding of greedy requests: an ONNX draft (``draft_model``) proposes, this model verifies."""
    speculative_k_max: int = Field(default=8, ge=1, le=32)
    """Most draft tokens per verify pass (k adapts to the acceptance rate within 1..k_max)."""
    draft_model: str = ""
    """onnxruntime-genai model directory of the draft; empty uses `<models_dir>/<model_id>/draft-int8` (built by
    `meshserve models prepare`), else the edge tier's `<models_dir>/<model_id>/edge-int4`."""

    @model_validator(mode="after")
    def _check_dtype(self) -> GpuWorkerSettings:
        if self.device == "cpu" and self.dtype == "float16":
            raise ConfigError(
                "float16 is slow and inaccurate on CPU; set MESHSERVE_GPU_WORKER_DTYPE to float32 or auto"
            )
        if self.redis_url:
            from services.store.connection import redis_from_url

            try:
                redis_from_url(self.redis_url, 1.0)
            except ValueError as exc:
                raise ConfigError(f"MESHSERVE_GPU_WORKER_REDIS_URL: {exc}") from None
        return self

    def resolved_draft_model(self) -> str:
        """The draft's directory, or ConfigError saying how to get one (speculative decoding only)."""
        paths = model_paths(self.model_id)
        path = Path(self.draft_model) if self.draft_model else paths.default_draft()
        if not (path / "genai_config.json").is_file():
            where = path if self.draft_model else f"{paths.draft_dir} or {paths.edge_dir}"
            raise ConfigError(
                f"no onnxruntime-genai draft model at {where}; run `meshserve models prepare`, set "
                "MESHSERVE_GPU_WORKER_DRAFT_MODEL, or turn MESHSERVE_GPU_WORKER_SPECULATIVE off"
            )
        return str(path)

    def resolved_load_cache_dir(self) -> Path | None:
        if not self.load_cache:
            return None
        return self.load_cache_dir or default_load_cache_dir("cloud")

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


class TorchrunSettings(BaseSettings):
    """This process's place in its tensor-parallel group: the variables torchrun sets for each rank
    (``meshserve up --cloud-tp N``, deploy/'s GPU overlay). None of them when the worker runs as a
    single rank."""

    model_config = SettingsConfigDict(extra="ignore", case_sensitive=True, frozen=True)

    rank: int = Field(default=0, validation_alias="RANK")
    """This rank's index in the group; rank 0 serves, the others follow its steps."""
    world_size: int = Field(default=1, validation_alias="WORLD_SIZE")
    """Ranks in the group (the tensor-parallel degree)."""
    local_rank: int | None = Field(default=None, validation_alias="LOCAL_RANK")
    """This rank's index on its machine, which picks its GPU (unset: ``rank``)."""
