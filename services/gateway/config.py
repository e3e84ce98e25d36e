"""Gateway settings (env prefix ``MESHSERVE_GATEWAY_``, YAML section ``gateway:``)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings
from services.gateway.auth import parse_api_keys


class GatewaySettings(ServiceSettings):
    """Settings of the public gateway; parsed once in ``__main__``."""

    service: ClassVar[str] = "gateway"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_GATEWAY_", extra="ignore")

    router_address: str = "127.0.0.1:50052"
    """host:port of the router's `meshserve.v1.Inference` service."""
    api_keys: str = ""
    """Accepted API keys as comma-separated `tenant:sha256hex` entries (the SHA-256 of each key, never
    the key itself); make one with `python -c "import hashlib;print(hashlib.sha256(b'KEY').hexdigest())"`."""
    default_deadline_s: float = Field(default=120.0, gt=0)
    """Deadline given to a Generate/Complete/ListModels call whose caller set none."""
    default_chat_deadline_s: float = Field(default=900.0, gt=0)
    """Deadline of a whole Chat session (all its turns) whose caller set none."""
    max_deadline_s: float = Field(default=600.0, gt=0)
    """Upper bound on any request's deadline, whatever the caller asked for."""
    max_prompt_chars: int = Field(default=32_000, ge=1)
    """Longest accepted prompt (Generate) or total message text of one chat turn, in characters."""
    max_tokens_limit: int = Field(default=4096, ge=1)
    """Largest accepted `sampling.max_tokens`."""
    max_stop_strings: int = Field(default=8, ge=0)
    """Most stop strings per request."""
    max_stop_chars: int = Field(default=64, ge=1)
    """Longest accepted stop string, in characters."""
    max_chat_messages: int = Field(default=64, ge=1)
    """Most messages in one chat turn."""
    max_model_chars: int = Field(default=128, ge=1)
    """Longest accepted model id."""

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: str) -> str:
        parse_api_keys(value)  # raises ValueError with the fix; pydantic wraps it with the var name
        return value
