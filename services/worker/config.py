"""Settings every worker tier has (the tiers subclass this and add their model options)."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from services.common.config import StreamingSettings
from services.common.errors import ConfigError
from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from services.common.sampling import DEFAULT_MAX_TOKENS


class WorkerSettings(StreamingSettings):
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
    default_max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    """Tokens generated when a request leaves max_tokens at 0 (clamped to the context)."""
    max_open_chats: int = Field(default=16, ge=0)
    """Chat streams whose KV is kept between turns; beyond it the least recently used is freed
    (its next turn prefills the whole context again). 0 keeps none."""
    chat_idle_timeout_s: float = Field(default=120.0, gt=0)
    """A chat's KV kept between turns is freed after this many idle seconds."""
    queued_keepalive_s: float = Field(default=1.0, gt=0)
    """While a turn waits for a slot or for its first token (prefill), a keepalive frame goes to the
    router this often, so queueing or a long prefill is not taken for a stall (keep it well under the
    router's stall_timeout_s)."""
    warmup: bool = True
    """Run a tiny generation before health reports SERVING (keeps the first request fast)."""
    model_version: str = ""
    """Version of the served model in KV block hashes; empty reads the prepared model's manifest
    (`meshserve models prepare`), as the router does, so both hash prefixes alike."""
    router_address: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Routers to register with (comma-separated host:port); empty = no self-registration (the router
    then needs this worker in its static list)."""
    router_resolve: bool = False
    """Re-resolve each router_address host name by DNS every heartbeat interval and heartbeat to every
    address it lists (a Kubernetes headless Service names all router replicas: every replica learns
    every worker). Off: each address is one gRPC target (a normal Service reaches one replica)."""
    advertise_address: str = ""
    """host:port routers should call this worker on; empty = `<host>:<bound port>` (the hostname when
    listening on 0.0.0.0)."""
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    """Seconds between heartbeats (shortened to a third of the TTL a router answers with)."""
    heartbeat_timeout_s: float = Field(default=1.0, gt=0)
    """Timeout of one heartbeat call; a router that does not answer is retried with backoff."""
    prefix_block_tokens: int = Field(default=16, ge=1)
    """Block size of the hot prefix block hashes in load reports (the router's prefix_block_tokens)."""
    max_hot_blocks: int = Field(default=1024, ge=0)
    """Most hot prefix block hashes (32 bytes each) one load report carries."""
    fault_first_token_delay_s: float = Field(default=0.0, ge=0.0, le=60.0)
    """Testing only (fault injection): hold back each turn's first frame this many seconds, as a slow
    build would (the router sees the TTFT; the sequence itself runs at full speed). 0, the default, is
    off; keep it under the router's stall_timeout_s. Shows the automatic rollback of a slow canary on
    real workers (tests/integration/router/test_model_versions_real.py)."""
    sleep_memory_margin_bytes: int = Field(default=64 << 20, ge=0)
    """Worker.Wake loads the model only if the host's available memory (MemAvailable) holds what the
    model took when it was last awake plus this margin; else RESOURCE_EXHAUSTED and the worker stays
    asleep (services/worker/sleep.py)."""
    stream_port: int = Field(default=0, ge=0, le=65535)
    """Port of the stream transport (plain TCP on ``host``; services/common/muxwire.py), where routers
    send every request stream: 0 picks a free port (announced in the load report). Routers must be
    able to reach it on the host of the worker's advertised address, like the gRPC port: behind NAT
    or a proxy, forward it too."""

    @field_validator("router_address", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("router_address")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for addr in value:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"router address {addr!r} must be host:port, e.g. 127.0.0.1:50052")
        return value

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if not self.model_id.strip():
            raise ConfigError("model_id is empty; set it to the id the router uses, e.g. smollm2-135m-instruct")
        if self.advertise_address:
            host, sep, port = self.advertise_address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"advertise_address {self.advertise_address!r} must be host:port, e.g. 10.0.0.7:7101")
        return self

    def resolved_model_version(self) -> str:
        """``model_version`` or the prepared model's version ("unprepared" when there is none)."""
        return self.model_version or model_paths(self.model_id).version()

    def resolved_advertise_address(self, port: int) -> str:
        """Where routers reach this worker once it is bound to ``port``."""
        if self.advertise_address:
            return self.advertise_address
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{port}"

    def resolved_worker_id(self, port: int | None = None) -> str:
        """``worker_id`` or one derived from the host and bound port (pid when not bound yet)."""
        if self.worker_id:
            return self.worker_id
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{port}" if port else f"{host}-pid{os.getpid()}"
