"""Batch runner settings (env prefix ``MESHSERVE_BATCH_``, YAML section ``batch:``)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings
from services.store.connection import check_redis_url


class BatchSettings(ServiceSettings):
    """Settings of one batch runner; parsed once in ``__main__``. ``port`` serves gRPC health only."""

    service: ClassVar[str] = "batch"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_BATCH_", extra="ignore")

    redis_url: str
    """Redis holding the files, batches and the work stream (the gateway's MESHSERVE_GATEWAY_REDIS_URL)."""
    router_addresses: str = "127.0.0.1:50052"
    """Comma-separated internal addresses of the routers (a gateway's embedded router port, or the router
    service): lines are sent to them in turn, and their replica view says how much capacity is free."""
    max_in_flight: int = Field(default=4, ge=1)
    """Most lines this runner runs at once, however much capacity is free."""
    reserve_slots: int = Field(default=1, ge=0)
    """Sequence slots of the workers left free for interactive requests: a line starts only while more
    than this many slots are free across the healthy replicas, and no replica has a queue."""
    capacity_poll_s: float = Field(default=0.2, gt=0)
    """How often the routers' replica view (RouterAdmin.ListReplicas) is read."""
    capacity_busy_poll_s: float = Field(default=1.0, gt=0)
    """How often it is read while the latest view showed interactive work (no line may start then
    anyway): fewer calls to the routers under interactive load. The quiet time a line waits for is
    still measured as with ``CAPACITY_POLL_S`` (the unseen part of a longer gap counts as busy)."""
    headroom: bool = True
    """Also wait for the interactive work to be idle (services/batch/capacity.py, docs/batch.md): a line
    starts only after the routers have run no interactive turn for ``HEADROOM_QUIET_S``, and the lines
    running grow by one per quiet view and halve at every busy one. False: free slots alone decide."""
    headroom_quiet_s: float = Field(default=0.5, ge=0)
    """How long the routers must have run no interactive turn before a line starts."""
    headroom_max_defer_s: float = Field(default=30.0, gt=0)
    """No starvation: after this long without a line started, one line starts alone even while
    interactive turns run (a load that never leaves the workers idle still sees its batch end)."""
    claim_idle_s: float = Field(default=30.0, gt=0)
    """A line held this long by a runner that stopped acknowledging (it died) is taken over; a live
    runner refreshes its lines' idle time every third of this."""
    sweep_interval_s: float = Field(default=2.0, gt=0)
    """How often this runner sweeps the live batches (expiry, cancellation, re-queueing)."""
    requeue_after_s: float = Field(default=30.0, gt=0)
    """A batch still `validating` this long after its creation (its gateway died while queueing it) is queued again."""
    cancel_grace_s: float = Field(default=5.0, ge=0)
    """After a cancel, how long lines already running may finish and be counted."""
    max_attempts: int = Field(default=3, ge=1)
    """Runs of a line that fails with DEADLINE_EXCEEDED, CANCELLED or INTERNAL before that is its answer
    (UNAVAILABLE and RESOURCE_EXHAUSTED, the mesh's state, are retried without limit)."""
    line_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of one line's request to the router."""
    consumer: str = ""
    """Name in the consumer group ("" = host name and process id); must be unique per live runner."""
    max_prompt_chars: int = Field(default=32_000, ge=1)
    """Longest prompt or chat turn of a line, in characters (the gateway's MAX_PROMPT_CHARS)."""
    max_tokens_limit: int = Field(default=4096, ge=1)
    """Largest `max_tokens` of a line (the gateway's MAX_TOKENS_LIMIT)."""

    _check_redis_url = field_validator("redis_url")(check_redis_url)

    @field_validator("router_addresses")
    @classmethod
    def _check_routers(cls, value: str) -> str:
        if not [a for a in value.split(",") if a.strip()]:
            raise ValueError("name at least one router address, e.g. 127.0.0.1:50052")
        return value

    def routers(self) -> list[str]:
        return [a.strip() for a in self.router_addresses.split(",") if a.strip()]
