"""Stored responses of the OpenAI Responses API (``POST /v1/responses`` with ``store``), per tenant, in Redis.

One JSON value per response under :func:`services.store.keys.stored_response_key` (the tenant's scope
digest is in the key: a tenant can never read, chain from or delete another's response), written
with the store's TTL. A record holds the response object as returned to the caller and the
conversation that led to it (input messages, earlier turns of a ``previous_response_id`` chain,
and this response's output), which the next turn of the chain prepends.

Failures: reading or deleting while Redis is unreachable raises :class:`Unavailable` (a chain
cannot continue without its history); writing fails open (logged): the caller still gets its
response, which then cannot be chained or fetched.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from redis.exceptions import RedisError

from services.common.errors import Unavailable
from services.store.connection import AnyRedis, redis_from_url
from services.store.keys import stored_response_key

log = structlog.get_logger(__name__)
_UNAVAILABLE = "the response store (Redis) is unavailable; retry in a few seconds"


class ResponseStore:
    """``put`` / ``get`` / ``delete`` of stored responses; ``scope`` is the tenant's digest
    (:func:`services.store.keys.scope_tag`, as the gateway sends it)."""

    def __init__(self, redis: AnyRedis, *, ttl_s: float) -> None:
        self._redis = redis
        self._ttl_ms = max(1, round(ttl_s * 1000))

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float, timeout_s: float) -> ResponseStore:
        return cls(
            redis_from_url(url, timeout_s, read_timeout_s=timeout_s, client_name="meshserve-responses"), ttl_s=ttl_s
        )

    async def put(self, scope: str, response_id: str, record: dict[str, Any]) -> bool:
        """Store ``record`` for the TTL; False (logged) when Redis could not take it."""
        try:
            await self._redis.set(stored_response_key(scope, response_id), json.dumps(record), px=self._ttl_ms)
        except (RedisError, OSError) as exc:
            log.warning("response_store_write_failed", response_id=response_id, error=type(exc).__name__)
            return False
        return True

    async def get(self, scope: str, response_id: str) -> dict[str, Any] | None:
        """The tenant's record, or None when it does not exist (never stored, expired, deleted, another's)."""
        try:
            raw = await self._redis.get(stored_response_key(scope, response_id))
        except (RedisError, OSError):
            raise Unavailable(_UNAVAILABLE) from None
        if raw is None:
            return None
        record: dict[str, Any] = json.loads(raw)
        return record

    async def delete(self, scope: str, response_id: str) -> bool:
        """Delete the tenant's record; False when there was none."""
        try:
            return bool(await self._redis.delete(stored_response_key(scope, response_id)))
        except (RedisError, OSError):
            raise Unavailable(_UNAVAILABLE) from None

    async def close(self) -> None:
        await self._redis.aclose()
