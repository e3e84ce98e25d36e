"""Typed settings: one class per service, read once at start; and the command-line tools' defaults.

Services: sources, highest priority first: environment variables ``MESHSERVE_<SERVICE>_<FIELD>``,
then the section ``<service>:`` of the YAML file named by ``MESHSERVE_CONFIG`` (optional), then
defaults. Invalid values, and unknown keys in a YAML section, raise :class:`ConfigError` with a
message naming the variable and the fix.

The command-line tools (``meshserve chat|up|keys|cache|status``) take their defaults from
:class:`ClientSettings`, the caller's environment only.

Every named environment variable of services/ is read here (tests/unit/test_import_graph.py checks
that no other module reads one).
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from services.common.coalesce import FlushWindow
from services.common.errors import ConfigError

CONFIG_ENV = "MESHSERVE_CONFIG"
DEFAULT_INTERNAL_TOKEN = "meshserve-dev-internal-token"
DEFAULT_ADDRESS = "127.0.0.1:50051"
"""The gateway's address in a local mesh (`meshserve up`'s default ``--port``)."""


def default_models_dir() -> Path:
    """Where prepared models live: ``$MESHSERVE_MODELS_DIR`` or ``~/.cache/meshserve/models``."""
    env = os.environ.get("MESHSERVE_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "meshserve" / "models"


def default_load_cache_dir(tier: str) -> Path:
    """Where a worker keeps what it derives from a model at start (``~/.cache/meshserve/load-cache/<tier>``):
    the running user's cache, whatever ``$MESHSERVE_MODELS_DIR`` is (a container's ``/models`` is
    read-only to its user, and the directory beside it is ``/``)."""
    return Path.home() / ".cache" / "meshserve" / "load-cache" / tier


class _YamlSection(PydanticBaseSettingsSource):
    """Reads this service's section of the YAML file named by MESHSERVE_CONFIG."""

    def __init__(self, settings_cls: type[BaseSettings], section: str) -> None:
        super().__init__(settings_cls)
        self._data: dict[str, Any] = {}
        path = os.environ.get(CONFIG_ENV)
        if not path:
            return
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read {CONFIG_ENV}={path}: {exc}; fix the path or the YAML") from exc
        section_data = doc.get(section, {}) if isinstance(doc, dict) else {}
        if not isinstance(section_data, dict):
            raise ConfigError(f"section '{section}' of {path} must be a mapping of setting: value")
        unknown = [str(key) for key in section_data if key not in settings_cls.model_fields]
        if unknown:  # a typo would otherwise leave the default in place without a word
            raise ConfigError(
                f"section '{section}' of {path} has unknown settings: "
                + ", ".join(_with_suggestion(key, settings_cls.model_fields) for key in unknown)
                + "; correct or remove them"
            )
        self._data = section_data

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def _with_suggestion(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"{key} (did you mean {close[0]}?)" if close else key


class YamlSettings(BaseSettings):
    """Settings from keyword arguments, then the environment, then section ``service`` of the YAML file
    named by MESHSERVE_CONFIG (the first that sets a field wins)."""

    service: ClassVar[str] = "common"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSection(settings_cls, cls.service))


class ServiceSettings(YamlSettings):
    """Settings every gRPC service has. Subclasses set ``service`` and ``model_config``."""

    model_config = SettingsConfigDict(extra="ignore")

    host: str = "127.0.0.1"
    """Address to listen on (loopback by default; use 0.0.0.0 in containers)."""
    port: int = Field(default=0, ge=0, le=65535)
    """gRPC port; 0 picks a free port (printed in the `service_started` log line)."""
    metrics_port: int = Field(default=-1, ge=-1, le=65535)
    """Prometheus /metrics HTTP port; 0 picks a free port, -1 disables the endpoint."""
    log_level: str = "INFO"
    """Log level: DEBUG, INFO, WARNING or ERROR."""
    log_json: bool = True
    """JSON log lines (true) or human-readable ones (false)."""
    internal_token: str = DEFAULT_INTERNAL_TOKEN
    """Shared secret that internal hops carry; workers and the router refuse calls without it."""
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    """On SIGTERM: seconds to let in-flight streams finish before they are cancelled."""

    @property
    def dev_token_exposed(self) -> bool:
        """Whether this service listens beyond loopback with the well-known development internal
        token: anyone who can reach the port can then call it as the mesh would."""
        if self.internal_token != DEFAULT_INTERNAL_TOKEN or self.host == "localhost":
            return False
        try:
            return not ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:  # a host name: it may resolve beyond loopback
            return True


class StreamingSettings(ServiceSettings):
    """Settings of a service that relays token streams (worker, router, gateway): the flush window."""

    flush_window_ms: float = Field(default=20.0, ge=0, le=1000)
    """While busy, a stream's token frames go out at least this far apart (tokens that come meanwhile
    share the next frame; the first token and the final frame are never held). 0 turns it off."""
    flush_busy_streams: int = Field(default=8, ge=1)
    """Busy = at least this many streams open through this process; below it frames are never held."""

    def flush_window(self) -> FlushWindow:
        return FlushWindow(self.flush_window_ms / 1000.0, self.flush_busy_streams)


S = TypeVar("S", bound=ServiceSettings)


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Build ``cls`` from env/YAML/defaults (plus explicit overrides), with readable errors."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        prefix = cls.model_config.get("env_prefix", "")
        problems = []
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if not name:  # a cross-field check: its message names the fields
                problems.append(msg)
                continue
            var = f"{prefix}{name}".upper() if prefix else name
            problems.append(f"{var}: {msg}{_shown_input(name, err.get('input'))}")
        raise ConfigError("invalid settings: " + "; ".join(problems)) from None


_SECRET_NAMES = ("token", "secret", "password", "api_keys")


def _shown_input(name: str, value: Any) -> str:
    """`` (got ...)`` for an error message, or nothing where that could print a secret: a missing
    field's input is every setting given (internal token included), and secrets stay out of logs."""
    if isinstance(value, dict) or any(s in name.lower() for s in _SECRET_NAMES) or "@" in str(value):
        return ""
    return f" (got {value!r})"


class ClientSettings(BaseSettings):
    """Defaults of the command-line tools, from the caller's environment (no YAML, no prefix: the
    variables keep the names users set). A flag given on the command line wins over each; an empty
    variable counts as unset where the tool then falls back to the running mesh's state file."""

    model_config = SettingsConfigDict(extra="ignore", case_sensitive=True, frozen=True)

    address: str = Field(default=DEFAULT_ADDRESS, validation_alias="MESHSERVE_ADDRESS")
    """``meshserve chat --address``: the gateway's host:port."""
    api_key: str | None = Field(default=None, validation_alias="MESHSERVE_API_KEY")
    """``meshserve chat --api-key``, and the dev tenant's key of the mesh ``meshserve up`` starts;
    unset: the local mesh's development key."""
    internal_token: str = Field(default=DEFAULT_INTERNAL_TOKEN, validation_alias="MESHSERVE_INTERNAL_TOKEN")
    """``meshserve cache|status --internal-token``: the mesh's internal credential."""
    cache_address: str = Field(default="", validation_alias="MESHSERVE_CACHE_ADDRESS")
    """``meshserve cache --address``: the cache service's host:port ("" = the running mesh's)."""
    router_address: str = Field(default="", validation_alias="MESHSERVE_ROUTER_ADDRESS")
    """``meshserve cache where --router``: the router's host:port ("" = the running mesh's)."""
    gateway_redis_url: str = Field(default="", validation_alias="MESHSERVE_GATEWAY_REDIS_URL")
    """``meshserve keys --redis-url``: the Redis holding the gateway's keys ("" = the running mesh's,
    else redis://127.0.0.1:6379/0); the gateway reads the same variable for its own setting."""
    gateway_state_redis_url: str = Field(default="", validation_alias="MESHSERVE_GATEWAY_STATE_REDIS_URL")
    """``meshserve keys``: the gateway's state Redis, where its keys live when it has one of its own
    (wins over ``gateway_redis_url``); the gateway reads the same variable for its own setting."""
    redis_url: str = Field(default="", validation_alias="REDIS_URL")
    """``meshserve up --redis-url``: a Redis for the mesh to use ("" = start redis-server)."""
    state_redis_url: str = Field(default="", validation_alias="MESHSERVE_STATE_REDIS_URL")
    """``meshserve up --state-redis-url``: the Redis of the mesh's durable state (keys, files, batches,
    stored responses) ("" = start one with persistence when the mesh starts its cache Redis, else the
    ``--redis-url`` Redis)."""
    state_file: str = Field(default="", validation_alias="MESHSERVE_STATE_FILE")
    """Where ``meshserve up`` records the running mesh's addresses ("" = ~/.cache/meshserve/mesh.json)."""

    @property
    def state_path(self) -> Path:
        return Path(self.state_file) if self.state_file else Path.home() / ".cache" / "meshserve" / "mesh.json"

    @property
    def state_redis_dir(self) -> Path:
        """``meshserve up --state-dir``'s default: the state Redis's data directory, beside the state
        file (``~/.cache/meshserve/mesh.redis-state``), so batches and keys outlive a mesh restart."""
        return self.state_path.with_name(self.state_path.stem + ".redis-state")
