"""RouterSettings: env ``MESHSERVE_ROUTER_*`` or section ``router:`` of the MESHSERVE_CONFIG YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from services.common.settings import ServiceSettings, default_models_dir
from services.models.paths import DEFAULT_MODEL_ID, model_paths

WorkerList = Annotated[list[str], NoDecode]


class RouterSettings(ServiceSettings):
    """Settings of the router service."""

    service: ClassVar[str] = "router"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_ROUTER_", extra="ignore")

    edge_workers: WorkerList = Field(default_factory=list)
    """Edge worker replicas as comma-separated host:port (e.g. ``127.0.0.1:7101,127.0.0.1:7102``)."""
    cloud_workers: WorkerList = Field(default_factory=list)
    """Cloud (GPU) worker replicas as comma-separated host:port (one entry per TP group's rank 0)."""
    redis_url: str = ""
    """Redis for the response cache (redis://host:port/db); empty disables the cache."""
    model_id: str = DEFAULT_MODEL_ID
    """Id of the served model (ListModels, cache keys); requests naming another model are refused."""
    models_dir: Path = Field(default_factory=default_models_dir)
    """Directory prepared by `meshserve models prepare` (model version and default tokenizer)."""
    tokenizer_dir: Path | None = None
    """HF directory with tokenizer.json and chat_template.jinja; default <models_dir>/<model_id>/hf."""
    context_length: int = Field(default=8192, ge=16)
    """Maximum prompt + completion tokens of the model."""
    edge_max_prompt_tokens: int = Field(default=128, ge=0)
    """Prompts of at most this many tokens go to the edge tier, longer ones to the cloud tier."""
    retries_before_first_token: int = Field(default=2, ge=0)
    """Other replicas (of any tier) tried when a worker fails before sending a token."""
    default_max_tokens: int = Field(default=256, ge=1)
    """max_tokens used when a request leaves it at 0."""
    cache_ttl_s: int = Field(default=3600, ge=1)
    """Lifetime of a response-cache entry in seconds."""
    cache_max_entry_bytes: int = Field(default=1 << 20, ge=64)
    """Responses whose encoded entry is larger than this are not cached."""
    cache_timeout_s: float = Field(default=0.05, gt=0)
    """Timeout of each Redis call; a slower Redis counts as a cache miss."""
    cache_retry_after_s: float = Field(default=1.0, ge=0)
    """After a Redis error the cache is skipped for this long (an outage costs one timeout)."""
    health_interval_s: float = Field(default=1.0, gt=0)
    """How often each worker's gRPC health and Stats are polled."""
    health_timeout_s: float = Field(default=0.5, gt=0)
    """Timeout of one health/Stats probe; a worker that does not answer in time is marked down."""

    @field_validator("edge_workers", "cloud_workers", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("edge_workers", "cloud_workers")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for addr in value:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"worker address {addr!r} must be host:port, e.g. 127.0.0.1:7101")
        return value

    @model_validator(mode="after")
    def _check(self) -> RouterSettings:
        if not self.edge_workers and not self.cloud_workers:
            raise ValueError(
                "no workers configured; set MESHSERVE_ROUTER_EDGE_WORKERS and/or MESHSERVE_ROUTER_CLOUD_WORKERS"
            )
        if self.default_max_tokens >= self.context_length:
            raise ValueError("default_max_tokens must be smaller than context_length; lower it")
        return self

    @property
    def hf_dir(self) -> Path:
        """Where the tokenizer is read from."""
        return self.tokenizer_dir or model_paths(self.model_id, self.models_dir).hf_dir

    def model_version(self) -> str:
        return model_paths(self.model_id, self.models_dir).version()
