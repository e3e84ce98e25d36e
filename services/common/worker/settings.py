"""Settings every worker tier has (the tiers subclass this and add their model options)."""

from __future__ import annotations

import os
import socket

from pydantic import Field, model_validator

from services.common.errors import ConfigError
from services.common.settings import ServiceSettings
from services.models.paths import DEFAULT_MODEL_ID


class WorkerSettings(ServiceSettings):
    """Shared worker settings: identity, concurrency bounds, threads, warm-up."""

    model_id: str = DEFAULT_MODEL_ID
    """Model id reported to the router and in Stats (the router routes by it)."""
    worker_id: str = ""
    """Replica id in Stats and logs; empty derives `<host>:<port>` (or `<host>-pid<pid>` before binding)."""
    threads: int = Field(default=0, ge=0)
    """Intra-op threads of the model runtime; 0 keeps the library default."""
    max_active_sequences: int = Field(default=4, ge=1, le=256)
    """Sequences generating at once; more wait in the queue."""
    max_queue: int = Field(default=16, ge=0)
    """Sequences that may wait for a slot; beyond it requests get RESOURCE_EXHAUSTED."""
    default_max_tokens: int = Field(default=256, ge=1)
    """Tokens generated when a request leaves max_tokens at 0 (clamped to the context)."""
    max_open_chats: int = Field(default=16, ge=0)
    """Chat streams whose KV is kept between turns; beyond it the least recently used is freed
    (its next turn prefills the whole context again). 0 keeps none."""
    chat_idle_timeout_s: float = Field(default=120.0, gt=0)
    """A chat's KV kept between turns is freed after this many idle seconds."""
    warmup: bool = True
    """Run a tiny generation before health reports SERVING (keeps the first request fast)."""

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if not self.model_id.strip():
            raise ConfigError("model_id is empty; set it to the id the router uses, e.g. smollm2-135m-instruct")
        return self

    def resolved_worker_id(self, port: int | None = None) -> str:
        """``worker_id`` or one derived from the host and bound port (pid when not bound yet)."""
        if self.worker_id:
            return self.worker_id
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{port}" if port else f"{host}-pid{os.getpid()}"
