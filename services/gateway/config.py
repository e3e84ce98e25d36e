"""Gateway settings (env prefix ``MESHSERVE_GATEWAY_``, YAML section ``gateway:``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import StreamingSettings
from services.common.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from services.gateway.auth import parse_api_keys
from services.gateway.policy import PolicyBook, TenantPolicy
from services.store.connection import check_redis_url


class GatewaySettings(StreamingSettings):
    """Settings of the public gateway; parsed once in ``__main__``."""

    service: ClassVar[str] = "gateway"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_GATEWAY_", extra="ignore")

    router_address: str = "127.0.0.1:50052"
    """host:port of the router's `meshserve.v1.Inference` service when the router runs as its own
    process (`embed_router` false); giving it turns `embed_router`'s default to false."""
    embed_router: bool = True
    """Run the router inside this process and call it in place, without a gRPC hop (settings from
    MESHSERVE_ROUTER_*; it serves workers' registrations and `meshserve status` on its own port,
    MESHSERVE_ROUTER_PORT; it reads the prepared model's tokenizer). The default, as under `meshserve
    up`, compose and Kubernetes, unless `router_address` is given: then false, the split layout
    (`meshserve up --split-router`). See services/router/frontend/api.py."""
    overlap_admission: bool = True
    """With `embed_router`: the router prepares a request (tokenize, cache lookup, replica choice, worker
    call) while its rate-limit reservation is in flight; the worker gets work, and the caller an answer,
    only once it is admitted. A tenant refused in the last `refused_serial_s` is admitted first."""
    refused_serial_s: float = Field(default=10.0, ge=0)
    """How long after a tenant's last rate-limit refusal its requests are admitted before routing."""
    speculative_starts: int = Field(default=1, ge=0)
    """With `overlap_admission`: how many requests per tenant (per gateway) may start on a worker before
    their reservation is known, so the Redis round trip overlaps the prefill; a refusal aborts the
    worker's turn. None for a tenant refused in the last `refused_serial_s`; 0 = never."""
    api_keys: str = ""
    """Accepted API keys as comma-separated `tenant:sha256hex` entries (the SHA-256 of each key, never
    the key itself); make one with `python -c "import hashlib;print(hashlib.sha256(b'KEY').hexdigest())"`."""
    default_deadline_s: float = Field(default=120.0, gt=0)
    """Deadline given to a Generate/Complete/ListModels call whose caller set none."""
    default_chat_deadline_s: float = Field(default=900.0, gt=0)
    """Deadline of a whole Chat session (all its turns) whose caller set none."""
    max_deadline_s: float = Field(default=600.0, gt=0)
    """Upper bound on a Generate/Complete/ListModels call's deadline, whatever the caller asked for."""
    max_chat_deadline_s: float = Field(default=3600.0, gt=0)
    """Upper bound on a whole Chat session's deadline (all its turns), whatever the caller asked for."""
    access_log: bool = True
    """One `request_done` log line per call (method, status, tier, worker, tokens, TTFT, duration)."""
    log_prompts: bool = False
    """Debugging only: the access log line also carries the call's prompts (each clipped to 2,000 chars)."""
    max_prompt_chars: int = Field(default=32_000, ge=1)
    """Longest accepted prompt (Generate) or total message text of one chat turn, in characters."""
    max_tokens_limit: int = Field(default=4096, ge=1)
    """Largest accepted `sampling.max_tokens`."""
    max_stop_strings: int = Field(default=MAX_STOP_STRINGS, ge=0, le=MAX_STOP_STRINGS)
    """Most stop strings per request (may only tighten the mesh's limit, ``services.common.sampling``)."""
    max_stop_chars: int = Field(default=MAX_STOP_CHARS, ge=1, le=MAX_STOP_CHARS)
    """Longest accepted stop string, in characters (may only tighten the mesh's limit)."""
    max_chat_messages: int = Field(default=64, ge=1)
    """Most messages in one chat turn."""
    max_model_chars: int = Field(default=128, ge=1)
    """Longest accepted model id."""
    max_embed_inputs: int = Field(default=2048, ge=1)
    """Most inputs of one Embed request (OpenAI's limit); each text at most `max_prompt_chars` characters."""
    max_embed_chars: int = Field(default=1_000_000, ge=1)
    """Most characters of text, and most token ids, of one Embed request, all inputs together (the router
    bounds the tokens: `MESHSERVE_ROUTER_MAX_EMBED_TOKENS`)."""

    redis_url: str = ""
    """Redis of the rate limiter (its buckets and stream leases: short-lived, may sit in a cache Redis),
    and of the durable state unless `state_redis_url` is set ("" = neither: static keys/JWT only, no limits):
    redis://host:port/db, rediss://..., redis+sentinel://h:26379/master[/db] or redis+cluster://h:7000."""
    state_redis_url: str = ""
    """Redis of the gateway's durable state: the API keys of `meshserve keys`, and the files and batches
    of the Files and Batches APIs ("" = `redis_url`, one Redis for everything). Point it at a Redis
    with persistence (appendonly yes) and `maxmemory-policy noeviction`: a cache Redis (allkeys-lru)
    may evict a key or a batch under memory pressure (docs/architecture.md, *Cache and state Redis*).
    Same URL forms as `redis_url`."""
    redis_timeout_s: float = Field(default=0.25, gt=0)
    """Timeout of one Redis call of the key store or the limiter."""
    redis_max_connections: int = Field(default=128, ge=1)
    """Most Redis connections the gateway opens; a call beyond them fails like a Redis outage."""
    redis_pipelined: bool = True
    """Run the rate limiter's admit/settle scripts over one pipelined connection (services/store/pipelined.py,
    ~60 instead of ~150 µs of CPU per admission) when `redis_url` is a plain `redis://` URL; false = redis-py."""
    key_cache_ttl_s: float = Field(default=1.0, ge=0)
    """Seconds a stored API key's record is reused without asking Redis; also the longest a revoked
    key keeps working on a gateway that had just seen it (0 = ask Redis on every request)."""
    rate_limit_failure_mode: Literal["open", "closed"] = "open"
    """Redis unreachable: `open` admits without limits, `closed` rejects with UNAVAILABLE."""
    rate_limit_retry_s: float = Field(default=1.0, gt=0)
    """After a Redis failure, seconds before the limiter tries Redis again (recovery is automatic)."""
    jwt_hs256_secret: str = ""
    """Shared secret of HS256 bearer JWTs ("" = HS256 not accepted)."""
    jwt_jwks_file: str = ""
    """Path of a JWKS JSON file with the RS256/ES256 public keys of bearer JWTs ("" = none)."""
    jwt_audience: str = ""
    """Required `aud` of bearer JWTs ("" = not checked)."""
    jwt_issuer: str = ""
    """Required `iss` of bearer JWTs ("" = not checked)."""
    jwt_tenant_claim: str = "tenant"
    """Claim of a bearer JWT that names the tenant."""
    jwt_models_claim: str = "models"
    """Claim of a bearer JWT that limits it to some model ids (a list of ids, or one space-separated
    string); a token without it may use every served model (docs/gateway.md, *Authentication*)."""
    jwt_leeway_s: float = Field(default=30.0, ge=0)
    """Clock skew tolerated on `exp`/`nbf`."""
    requests_per_minute: int = Field(default=600, ge=0)
    """Default tenant policy: requests per minute (0 = unlimited)."""
    request_burst: int = Field(default=0, ge=0)
    """Default tenant policy: requests admitted at once from an idle bucket (0 = requests_per_minute)."""
    tokens_per_minute: int = Field(default=200_000, ge=0)
    """Default tenant policy: prompt + completion tokens per minute (0 = unlimited)."""
    max_concurrent_streams: int = Field(default=16, ge=0)
    """Default tenant policy: open Generate/Chat streams at once across all gateways (0 = unlimited)."""
    max_prompt_tokens: int = Field(default=8192, ge=0)
    """Default tenant policy: longest prompt, in estimated tokens (0 = unlimited)."""
    priority_class: int = Field(default=5, ge=0, le=9)
    """Default tenant policy: highest routing priority a request may ask for."""
    batch_lines_in_flight: int = Field(default=50_000, ge=0)
    """Default tenant policy: most lines of a tenant's unfinished batches at once (0 = unlimited)."""
    batch_file_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    """Default tenant policy: most bytes of files (Files API) a tenant stores (0 = unlimited)."""
    batch_max_file_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=15 * 1024 * 1024)
    """Largest file one upload may hold (below the 16 MiB gRPC message limit)."""
    batch_max_lines: int = Field(default=50_000, ge=1)
    """Most requests in one batch input file."""
    batch_max_window_s: int = Field(default=86_400, ge=1)
    """Longest completion window a batch may ask for (OpenAI's only value is "24h")."""
    tenant_policies: dict[str, dict[str, int]] = Field(default_factory=dict)
    """Per-tenant overrides, e.g. `{"acme": {"requests_per_minute": 60, "max_tokens": 512}}` (JSON in env)."""

    def policy_book(self) -> PolicyBook:
        """Defaults from these settings plus ``tenant_policies``."""
        default = TenantPolicy(
            requests_per_minute=self.requests_per_minute,
            request_burst=self.request_burst,
            tokens_per_minute=self.tokens_per_minute,
            max_concurrent_streams=self.max_concurrent_streams,
            max_prompt_tokens=self.max_prompt_tokens,
            max_tokens=self.max_tokens_limit,
            priority=self.priority_class,
            batch_lines_in_flight=self.batch_lines_in_flight,
            batch_file_bytes=self.batch_file_bytes,
        )
        return PolicyBook(default, self.tenant_policies)

    @model_validator(mode="before")
    @classmethod
    def _split_when_given_a_router(cls, data: Any) -> Any:
        """A router address given (and `embed_router` not): the router runs elsewhere, call it there."""
        if isinstance(data, dict) and "router_address" in data and "embed_router" not in data:
            return {**data, "embed_router": False}
        return data

    @model_validator(mode="after")
    def _check_deadlines(self) -> GatewaySettings:
        if self.default_deadline_s > self.max_deadline_s:
            raise ValueError(
                f"default_deadline_s ({self.default_deadline_s:g}) is above max_deadline_s ({self.max_deadline_s:g}); "
                "lower the default or raise the cap"
            )
        if self.default_chat_deadline_s > self.max_chat_deadline_s:
            raise ValueError(
                f"default_chat_deadline_s ({self.default_chat_deadline_s:g}) is above max_chat_deadline_s "
                f"({self.max_chat_deadline_s:g}); lower the default or raise the cap"
            )
        return self

    @field_validator("tenant_policies")
    @classmethod
    def _check_policies(cls, value: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        PolicyBook(TenantPolicy(), value)  # raises ValueError naming the bad field
        return value

    _check_redis_url = field_validator("redis_url", "state_redis_url")(check_redis_url)

    @property
    def state_url(self) -> str:
        """The Redis of the durable state (keys, files, batches): `state_redis_url`, else `redis_url`."""
        return self.state_redis_url or self.redis_url

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: str) -> str:
        parse_api_keys(value)  # raises ValueError with the fix; pydantic wraps it with the var name
        return value
