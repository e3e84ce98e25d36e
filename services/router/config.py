"""RouterSettings: env ``MESHSERVE_ROUTER_*`` or section ``router:`` of the MESHSERVE_CONFIG YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from services.common.config import StreamingSettings, default_models_dir
from services.common.generation_defaults import NO_DEFAULTS, GenerationDefaults, read_generation_config
from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from services.common.sampling import DEFAULT_MAX_TOKENS
from services.router.balancer.policies import POLICIES
from services.store.connection import check_redis_url

WorkerList = Annotated[list[str], NoDecode]
TenantMap = Annotated[dict[str, float], NoDecode]


PREPARED = "prepared"
"""A version's ``build`` that means the model prepared in models_dir (its manifest version)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationSpec(_Strict):
    """Generation defaults in the models file or the settings (services/common/generation_defaults.py): what
    a request that leaves a sampling field unset gets. Each field set here overrides the layer below it
    (the checkpoint's generation_config.json < the model < its version < the operator's settings)."""

    temperature: float | None = None
    """0 to 2; 0 is greedy."""
    top_p: float | None = None
    """Above 0, at most 1 (1: off)."""
    top_k: int | None = None
    """0 (off) or more."""
    repetition_penalty: float | None = None
    """Above 0, at most 2 (1: off); never applied to a turn under structured output or with callable tools."""
    max_tokens: int | None = None
    """1 or more: a request's max_tokens 0 (clamped to the room its prompt leaves in the context)."""
    stop: list[str] | None = None
    """At most 8 stop strings of 1 to 64 characters."""

    @model_validator(mode="after")
    def _ranges(self) -> GenerationSpec:
        self.defaults("generation")
        return self

    def defaults(self, where: str) -> GenerationDefaults:
        """These defaults, checked against the requests' own ranges (ValueError naming ``where``)."""
        return GenerationDefaults.from_mapping(self.model_dump(exclude_none=True), where)


class IdleSpec(_Strict):
    """A model version's idle policy (docs/router.md, *Scale from zero*): after ``idle_after_s`` without a
    request its replicas beyond ``min_replicas`` go to sleep (the process stays, the model's memory is
    released); a request for it then is held while one wakes."""

    min_replicas: int = Field(default=1, ge=0)
    """Replicas kept awake however idle the version is; 0: all of them may sleep (or stop, with
    ``stop_after_s``), and a request arriving with none running is held until one starts."""
    idle_after_s: float | None = Field(default=None, gt=0)
    """Seconds without a request after which replicas beyond ``min_replicas`` sleep; null: never."""
    stop_after_s: float | None = Field(default=None, gt=0)
    """Seconds without a request after which `meshserve up` stops the version's worker processes (needs
    ``min_replicas: 0``); null: never. The router itself only exports the idle time
    (``meshserve_router_idle_seconds``)."""

    @model_validator(mode="after")
    def _stop_needs_zero(self) -> IdleSpec:
        if self.stop_after_s is not None and self.min_replicas > 0:
            raise ValueError(
                f"stop_after_s stops every replica, but min_replicas is {self.min_replicas}; "
                "set min_replicas to 0 or drop stop_after_s"
            )
        return self


class VersionSpec(_Strict):
    """One version of a served model in the models file."""

    name: str = Field(min_length=1)
    """What rollouts call it (``--weights v1=95,v2=5``)."""
    build: str = ""
    """The ``model_version`` its workers report (their MESHSERVE_*_WORKER_MODEL_VERSION, or the prepared
    model's manifest version); empty: the name; ``prepared``: the manifest version of the model prepared
    in models_dir (what workers started without MODEL_VERSION report)."""

    generation: GenerationSpec = Field(default_factory=GenerationSpec)
    """This version's generation defaults, over its model's (a build that wants other sampling)."""
    idle: IdleSpec | None = None
    """This version's idle policy, in place of its model's (the whole block; unset: the model's)."""

    @property
    def build_id(self) -> str:
        return self.build or self.name


class RollbackSpec(_Strict):
    """Automatic rollback of a canary (services/router/frontend/rollout.py, RollbackRule)."""

    error_rate_margin: float = Field(default=0.05, ge=0)
    ttft_p99_margin_ms: float = Field(default=500.0, ge=0)
    window_s: float = Field(default=60.0, gt=0)
    min_samples: int = Field(default=50, ge=1)


class RolloutSpec(_Strict):
    """A model's starting rollout policy; `meshserve models rollout` changes it at run time."""

    weights: dict[str, int] = Field(default_factory=dict)
    """version -> weight; empty: all traffic to the first version."""
    sticky: Literal["chat", "tenant"] = "chat"
    shadow: str | None = None
    rollback: RollbackSpec | None = None


class ModelSpec(_Strict):
    """One served model id: its versions, tokenizer, context length and rollout."""

    id: str = Field(min_length=1)
    context_length: int | None = Field(default=None, ge=16)
    """Default: the router's context_length."""
    tokenizer_dir: Path | None = None
    """HF directory with tokenizer.json (+ chat_template.jinja); default <models_dir>/<id>/hf."""
    versions: list[VersionSpec] = Field(default_factory=list)
    """Empty: one version, the model prepared in models_dir (named by its manifest version)."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    generation: GenerationSpec = Field(default_factory=GenerationSpec)
    """The model's generation defaults, over its checkpoint's generation_config.json (the tokenizer_dir's)."""
    idle: IdleSpec | None = None
    """The idle policy of its versions (unset: the router's ``idle_*`` settings; default: one replica
    always awake, never sleep)."""


class ModelsFile(_Strict):
    """The models file (YAML or JSON): every model id the router serves."""

    models: list[ModelSpec] = Field(min_length=1)
    default: str = ""
    """The model a request naming none is served by; empty: the first."""


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
    """Id of the served model (ListModels, cache keys); requests naming another model are refused.
    Ignored when ``models_file`` is set."""
    models_file: Path | None = None
    """YAML/JSON file declaring several models and their versions (:class:`ModelsFile`; docs/router.md,
    *Several models and versions*); unset: one model, ``model_id``, served by every worker."""
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
    routing_policy: str = "cache_aware"
    """Replica choice, a name in services/router/balancer/policies' ``POLICIES``: ``cache_aware``
    (bounded-load consistent hashing + longest prefix + P2C) or ``round_robin``."""
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
    hold_background_on_host: bool = True
    """While a foreground turn runs on any worker of a host (the host part of its address), tell that
    host's workers to hold their background sequences (batch lines), which share its cores
    (services/router/balancer/host_hold.py; docs/batch.md)."""
    eject_base_s: float = Field(default=1.0, gt=0)
    """First ejection of a failing replica lasts this long; each further one doubles it."""
    eject_max_s: float = Field(default=30.0, gt=0)
    """Longest ejection."""
    readmit_s: float = Field(default=10.0, ge=0)
    """A re-admitted replica ramps up to its full share of traffic over this many seconds."""
    default_max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    """max_tokens used when a request leaves it at 0 and its model has no default of its own (clamped to the
    room the prompt leaves in the context)."""
    generation_defaults: GenerationSpec = Field(default_factory=GenerationSpec)
    """The operator's generation defaults, over every served model's own (its checkpoint's
    generation_config.json, then the models file), as JSON: ``{"temperature": 0}`` makes every model greedy
    by default. A request's explicit field still wins (docs/router.md, *Generation defaults*)."""
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
    shadow_max_in_flight: int = Field(default=8, ge=0)
    """Shadow copies (a rollout's shadow version) running at once; more are shed, never delaying a caller."""
    rollout_poll_s: float = Field(default=1.0, gt=0, le=60)
    """With a models file and ``redis_url``: the rollout policies are shared by every router replica through
    Redis (services/router/frontend/rollout_sync.py); a change announced on pub/sub is applied at once, and every
    replica re-reads the policies at least this often (the bound when an announcement is lost)."""
    rollout_store_timeout_s: float = Field(default=0.5, gt=0)
    """Timeout of each call to the shared rollout store; a slower Redis counts as unreachable (the last known
    policies are kept)."""
    max_queued_chat_turns: int = Field(default=8, ge=1)
    """Turns one Chat stream may send ahead of the turn in progress; one more ends the stream with
    RESOURCE_EXHAUSTED once that turn ends (the router stops reading the stream at once, so memory stays bounded)."""
    max_embed_tokens: int = Field(default=65_536, ge=1)
    """Most tokens of one Embed request, all its inputs together; more is refused with INVALID_ARGUMENT."""
    max_replicas: int = Field(default=1024, ge=1)
    """Most workers (static + self-registered) the router holds; a heartbeat from a new address beyond it
    is refused with RESOURCE_EXHAUSTED (a fleet announcing endless addresses cannot grow the router)."""
    kv_high_watermark: float = Field(default=0.95, gt=0, le=1)
    """A worker reporting this fraction of its KV budget in use gets no new turns while another has room."""
    health_interval_s: float = Field(default=1.0, gt=0)
    """How often each worker's gRPC health and Stats are polled."""
    health_timeout_s: float = Field(default=0.5, gt=0)
    """Timeout of one health/Stats probe."""
    idle_min_replicas: int = Field(default=1, ge=0)
    """The idle policy of a model that has none in the models file (and of the one model without a models file):
    replicas kept awake however idle (:class:`IdleSpec`; docs/router.md, *Scale from zero*)."""
    idle_after_s: float | None = Field(default=None, gt=0)
    """Idle policy default: seconds without a request after which replicas beyond ``idle_min_replicas`` sleep;
    unset: never."""
    idle_stop_after_s: float | None = Field(default=None, gt=0)
    """Idle policy default: seconds without a request after which `meshserve up` stops the workers (needs
    ``idle_min_replicas`` 0); unset: never."""
    wake_deadline_s: float = Field(default=60.0, gt=0)
    """A request held while its model wakes (or a worker starts) waits at most this long, then gets UNAVAILABLE
    (HTTP 503) with a retry-after."""
    max_held_per_model: int = Field(default=1024, ge=1)
    """Requests held at once per model version while it wakes; one more is refused with RESOURCE_EXHAUSTED
    (HTTP 429) and a retry-after."""
    probe_timeouts_to_down: int = Field(default=3, ge=1, le=100)
    """A healthy worker is marked down after this many probes in a row time out (1 = the first).
    Refused connections and NOT_SERVING mark it down at once; stalled streams eject it at once."""

    _check_redis_url = field_validator("redis_url")(check_redis_url)
    _models: ModelsFile | None = PrivateAttr(default=None)

    @field_validator("routing_policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
        return name

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
        if self.idle_stop_after_s is not None and self.idle_min_replicas > 0:
            raise ValueError(
                f"MESHSERVE_ROUTER_IDLE_STOP_AFTER_S stops every replica, but MESHSERVE_ROUTER_IDLE_MIN_REPLICAS "
                f"is {self.idle_min_replicas}; set it to 0 or unset the stop"
            )
        if self.models_file is not None:
            self._models = _read_models_file(self.models_file)
            for spec in self._models.models:
                if spec.context_length is not None and self.default_max_tokens >= spec.context_length:
                    raise ValueError(f"default_max_tokens must be smaller than model {spec.id!r}'s context_length")
        return self

    def served_models(self) -> tuple[list[ModelSpec], str, bool]:
        """The models to serve, the default one, and whether replicas are told apart by the model id and
        version they report (False: no models file; every worker serves the one model, as before)."""
        if self._models is None:
            version = self.model_version()
            spec = ModelSpec(
                id=self.model_id,
                context_length=self.context_length,
                tokenizer_dir=self.hf_dir,
                versions=[VersionSpec(name=version)],
            )
            return [spec], self.model_id, False
        specs = [
            spec.model_copy(
                update={
                    "context_length": spec.context_length or self.context_length,
                    "tokenizer_dir": spec.tokenizer_dir or model_paths(spec.id, self.models_dir).hf_dir,
                    "versions": [
                        v.model_copy(update={"build": model_paths(spec.id, self.models_dir).version()})
                        if v.build == PREPARED
                        else v
                        for v in spec.versions
                    ]
                    or [VersionSpec(name=model_paths(spec.id, self.models_dir).version())],
                }
            )
            for spec in self._models.models
        ]
        return specs, self._models.default or specs[0].id, True

    def generation_defaults_for(self, spec: ModelSpec, version: VersionSpec) -> GenerationDefaults:
        """``version``'s generation defaults, every layer merged: the checkpoint's generation_config.json (in
        the model's tokenizer_dir), the model's and the version's entries of the models file, then the
        operator's :attr:`generation_defaults`. ValueError naming the source of a bad value."""
        where = f"models_file {self.models_file}: model {spec.id!r}" if self._models is not None else "settings"
        layers = [
            read_generation_config(spec.tokenizer_dir),
            spec.generation.defaults(f"{where}: generation"),
            version.generation.defaults(f"{where}: version {version.name!r}: generation"),
            self.generation_defaults.defaults("MESHSERVE_ROUTER_GENERATION_DEFAULTS"),
        ]
        merged = NO_DEFAULTS
        for layer in layers:
            merged = layer.over(merged)
        return merged

    def idle_for(self, spec: ModelSpec, version: VersionSpec) -> IdleSpec:
        """``version``'s idle policy: its own ``idle:``, else its model's, else the ``idle_*`` settings."""
        return (
            version.idle
            or spec.idle
            or IdleSpec(
                min_replicas=self.idle_min_replicas,
                idle_after_s=self.idle_after_s,
                stop_after_s=self.idle_stop_after_s,
            )
        )

    @property
    def hf_dir(self) -> Path:
        """Where the tokenizer is read from."""
        return self.tokenizer_dir or model_paths(self.model_id, self.models_dir).hf_dir

    def model_version(self) -> str:
        return model_paths(self.model_id, self.models_dir).version()


def _read_models_file(path: Path) -> ModelsFile:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read models_file {path}: {exc}; fix the path or the YAML") from exc
    try:
        parsed = ModelsFile.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"models_file {path}: {where}: {first['msg']}") from None
    ids = [m.id for m in parsed.models]
    if len(set(ids)) != len(ids):
        raise ValueError(f"models_file {path} names a model id twice; each id once")
    if parsed.default and parsed.default not in ids:
        raise ValueError(f"models_file {path}: default {parsed.default!r} is not one of its models ({', '.join(ids)})")
    for m in parsed.models:
        names = [v.name for v in m.versions]
        if len(set(names)) != len(names):
            raise ValueError(f"models_file {path}: model {m.id!r} names a version twice")
        named = [*m.rollout.weights, *([m.rollout.shadow] if m.rollout.shadow else [])]
        unknown = [v for v in named if names and v not in names]
        if unknown:
            raise ValueError(
                f"models_file {path}: model {m.id!r} has no version {unknown[0]!r}; it has {', '.join(names)}"
            )
    return parsed
