"""CacheSettings: env ``MESHSERVE_CACHE_*`` or section ``cache:`` of the MESHSERVE_CONFIG YAML.

These configure the cache *admin service*. The in-process caches of the router (and later the
workers) are configured in their own settings; the schema and encodings are the same code.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings
from services.store.connection import check_redis_url


class CacheSettings(ServiceSettings):
    """Settings of the cache admin service."""

    service: ClassVar[str] = "cache"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_CACHE_", extra="ignore")

    redis_url: str
    """Redis to administer: redis://host:port/db, redis+sentinel://h:26379/master, redis+cluster://h:7000."""
    router_address: str = ""
    """Router host:port, used by Warm to send shared system prompts (empty: Warm is refused)."""
    timeout_s: float = Field(default=5.0, gt=0)
    """Timeout of each Redis call of an admin operation (SCANs of a large keyspace take a while)."""
    warm_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of one warm-up request through the router (and never past the Warm caller's deadline)."""
    warm_max_prompts: int = Field(default=64, ge=1)
    """Prompts one Warm call may send (more is refused: split the list)."""
    warm_max_tokens: int = Field(default=256, ge=1)
    """Tokens a Warm call may ask per prompt (each prompt is a real generation request)."""
    max_keys: int = Field(default=1_000_000, ge=1)
    """Stats stop counting entries after this many keys per kind (bounds the SCAN)."""

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value:
            raise ValueError("set MESHSERVE_CACHE_REDIS_URL to the Redis the mesh uses, e.g. redis://127.0.0.1:6379/0")
        return check_redis_url(value)
