"""HTTP adapter settings (env prefix ``MESHSERVE_GATEWAY_HTTP_``, YAML section ``gateway_http:``)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings
from services.store.connection import check_redis_url


class HttpAdapterSettings(ServiceSettings):
    """Settings of the OpenAI-compatible HTTP adapter that sits behind Envoy; parsed once in ``__main__``.

    ``port`` (inherited) is the HTTP port; ``internal_token`` is unused: the adapter is a public
    client of the gateway and carries the caller's own ``Authorization`` header.
    """

    service: ClassVar[str] = "gateway_http"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_GATEWAY_HTTP_", extra="ignore")

    gateway_address: str = "127.0.0.1:50051"
    """gRPC target of the gateway's `meshserve.v1.Inference` service (any grpc target string)."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest accepted request body; bigger bodies get 413."""
    redis_url: str = ""
    """Redis of the stored responses of `POST /v1/responses` (`store`, `previous_response_id`, `GET` and
    `DELETE /v1/responses/{id}`); "" = none kept: `store` is ignored and `previous_response_id` refused.
    Same URL forms as the gateway's `redis_url`."""
    redis_timeout_s: float = Field(default=0.5, gt=0)
    """Timeout of one Redis call of the response store."""
    responses_ttl_s: float = Field(default=30 * 86400, gt=0)
    """How long a stored response is kept (from its creation): afterwards GET and `previous_response_id`
    answer 404. OpenAI keeps them 30 days."""

    _check_redis_url = field_validator("redis_url")(check_redis_url)
    max_file_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Largest file a POST /v1/files upload may carry (the gateway's MESHSERVE_GATEWAY_BATCH_MAX_FILE_BYTES
    applies too; keep them equal)."""
