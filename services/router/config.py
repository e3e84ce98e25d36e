"""RouterSettings: env ``MESHSERVE_ROUTER_*`` or section ``router:`` of the MESHSERVE_CONFIG YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from services.common.sampling import DEFAULT_MAX_TOKENS
from services.common.settings import StreamingSettings, default_models_dir
from services.store.connection import check_redis_url

WorkerList = Annotated[list[str], NoDecode]
TenantMap = Annotated[dict[str, float], NoDecode]


class RouterSettings(StreamingSettings):
    """Settings of the router service."""

    service: ClassVar[str] = "router"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_ROUTER_", extra="ignore")

    edge_workers: WorkerList = Field(default_factory=list)
    """Edge worker replicas as comma-separated host:port (e.g. ``127.0.0.1:7101,127.0.0.1:7102``)."""
    cloud_workers: WorkerList = Field(default_factory=list)
    """Cloud (GPU) worker replicas as comma-separated host:port (one entry per TP group's rank 0)."""
    redis_url: str = ""
    """Redis for the response cache (redis://host:port/db, redis+sentinel://h:26379/master[/db] or
    redis+cluster://h:7000); empty disables the cache."""
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
    failovers_after_first_token: int = Field(default=2, ge=0)
    """Times a stream is resumed on another replica after its worker died or stalled mid-generation."""
    resume_same_build_wait_s: float = Field(default=5.0, ge=0)
    """A stream resumed after its worker failed goes to a replica of the same build (same greedy tokens)
    first; when every one is busy it waits up to this long for a slot, then resumes on another build or
    tier (``route.reason`` ``failover_cross_build``). 0: do not wait."""
    stall_timeout_s: float = Field(default=30.0, gt=0)
    """A worker that sends nothing for this long is treated as failed (ejected, request failed over)."""
    routing_policy: Literal["cache_aware", "round_robin"] = "cache_aware"
    """Replica choice: bounded-load consistent hashing + longest prefix + P2C, or plain round-robin."""
    prefix_block_tokens: int = Field(default=16, ge=1)
    """Block size (tokens) of the prefix hashes used for cache-aware routing."""
    balance_epsilon: float = Field(default=0.25, gt=0)
    """No replica is given more than (1 + epsilon) times the average load of its tier."""
    replica_slots: int = Field(default=0, ge=0)
    """Concurrent turns the router sends to one replica; 0 = the worker's max_active_sequences."""
    ttft_slo_ms: int = Field(default=30000, ge=0)
    """Default TTFT objective: requests whose estimated TTFT is longer are shed (0 = never shed)."""
    tenant_ttft_slo_ms: TenantMap = Field(default_factory=dict)
    """Per-tenant TTFT objectives as tenant:ms pairs, comma-separated (e.g. ``acme:2000,free:8000``)."""
    tenant_weights: TenantMap = Field(default_factory=dict)
    """Fair-queuing weights as tenant:weight pairs (default 1); a weight of 2 gets twice the tokens."""
    tenant_tiers: Annotated[dict[str, list[str]], NoDecode] = Field(default_factory=dict)
    """Tenants restricted to some tiers, as tenant:tier pairs (e.g. ``free:edge,acme:edge,acme:cloud``)."""
    assumed_turn_s: float = Field(default=2.0, gt=0)
    """Initial estimate of how long a turn holds its slot (refined from observed turns)."""
    collapse_requests: bool = True
    """Serve identical concurrent deterministic requests with one computation."""
    eject_base_s: float = Field(default=1.0, gt=0)
    """First ejection of a failing replica lasts this long; each further one doubles it."""
    eject_max_s: float = Field(default=30.0, gt=0)
    """Longest ejection."""
    readmit_s: float = Field(default=10.0, ge=0)
    """A re-admitted replica ramps up to its full share of traffic over this many seconds."""
    default_max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    """max_tokens used when a request leaves it at 0 (clamped to the room the prompt leaves in the context)."""
    cache_ttl_s: int = Field(default=3600, ge=1)
    """Lifetime of a response-cache entry in seconds."""
    cache_max_entry_bytes: int = Field(default=1 << 20, ge=64)
    """Responses whose encoded entry is larger than this are not cached."""
    cache_timeout_s: float = Field(default=0.05, gt=0)
    """Timeout of each Redis call; a slower Redis counts as a cache miss."""
    cache_retry_after_s: float = Field(default=1.0, ge=0)
    """After a Redis error the cache is skipped for this long (an outage costs one timeout)."""
    accept_registrations: bool = True
    """Serve WorkerRegistry.Heartbeat: workers started with this router's address join the routing set."""
    heartbeat_ttl_s: float = Field(default=5.0, gt=0)
    """A self-registered worker (WorkerRegistry.Heartbeat) is forgotten after this long without a heartbeat."""
    max_queued_chat_turns: int = Field(default=8, ge=1)
    """Turns one Chat stream may send ahead of the turn in progress; one more ends the stream with
    RESOURCE_EXHAUSTED once that turn ends (the router stops reading the stream at once, so memory stays bounded)."""
    max_replicas: int = Field(default=1024, ge=1)
    """Most workers (static + self-registered) the router holds; a heartbeat from a new address beyond it
    is refused with RESOURCE_EXHAUSTED (a fleet announcing endless addresses cannot grow the router)."""
    kv_high_watermark: float = Field(default=0.95, gt=0, le=1)
    """A worker reporting this fraction of its KV budget in use gets no new turns while another has room."""
    health_interval_s: float = Field(default=1.0, gt=0)
    """How often each worker's gRPC health and Stats are polled."""
    health_timeout_s: float = Field(default=0.5, gt=0)
    """Timeout of one health/Stats probe."""
    probe_timeouts_to_down: int = Field(default=3, ge=1, le=100)
    """A healthy worker is marked down after this many probes in a row time out (1 = the first).
    Refused connections and NOT_SERVING mark it down at once; stalled streams eject it at once."""

    _check_redis_url = field_validator("redis_url")(check_redis_url)

    @field_validator("edge_workers", "cloud_workers", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("tenant_ttft_slo_ms", "tenant_weights", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        out: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            tenant, sep, number = part.rpartition(":")
            try:
                out[tenant] = float(number)
            except ValueError:
                sep = ""
            if not sep or not tenant:
                raise ValueError(f"{part!r} must be tenant:number, e.g. acme:2000")
        return out

    @field_validator("tenant_tiers", mode="before")
    @classmethod
    def _tiers(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        out: dict[str, list[str]] = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            tenant, _, tier = part.rpartition(":")
            if not tenant or tier not in ("edge", "cloud"):
                raise ValueError(f"{part!r} must be tenant:edge or tenant:cloud")
            out.setdefault(tenant, []).append(tier)
        return out

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
        if not self.edge_workers and not self.cloud_workers and not self.accept_registrations:
            raise ValueError(
                "no workers configured and self-registration is off; set MESHSERVE_ROUTER_EDGE_WORKERS and/or "
                "MESHSERVE_ROUTER_CLOUD_WORKERS, or MESHSERVE_ROUTER_ACCEPT_REGISTRATIONS=true"
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
