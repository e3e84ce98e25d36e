"""Rollout policies shared by every router replica, in Redis: one hash per model with an epoch.

Layout (:func:`services.store.keys.rollout_key`)::

    meshserve:v1:{rollout|<model>}:policy    hash: epoch, policy (JSON), by, reason, at

A write runs one script that numbers the policy one above both the stored ``epoch`` and the
writer's own (its ``floor``: a Redis that lost its data does not restart the count below what the
replicas hold), stores it and publishes the model id on
:data:`services.store.keys.ROLLOUT_CHANNEL`, so writes of one model are totally ordered and a reader
applies a policy only when its epoch is newer than the one it holds (a late notice, or a poll that
crosses a write, never steps back). The policy is an opaque JSON object here; the router's rollout
domain (services/router/frontend/rollout.py) gives it meaning.

Every call is bounded by ``timeout_s``; any Redis failure (an error, a timeout, a closed connection)
raises :class:`~services.common.errors.Unavailable`, so callers decide how to fail open without
knowing redis-py. :class:`Notices` waits for announced changes; a client without pub/sub (or a lost
subscription) still returns after the poll interval, so a reader that also re-reads on every return
sees each change within that interval.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from redis.exceptions import RedisError

from services.common.errors import Unavailable
from services.store.connection import AnyRedis, redis_from_url
from services.store.keys import ROLLOUT_CHANNEL, rollout_key

log = structlog.get_logger(__name__)
_UNAVAILABLE = "the rollout store (Redis) is unreachable"
_WRITE = """
if ARGV[8] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local epoch = math.max(tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0'), tonumber(ARGV[7])) + 1
redis.call('HSET', KEYS[1], 'epoch', epoch, 'policy', ARGV[1], 'by', ARGV[2], 'reason', ARGV[3], 'at', ARGV[4])
redis.call('PUBLISH', ARGV[5], ARGV[6])
return epoch
"""


@dataclass(frozen=True)
class StoredPolicy:
    """A model's policy as last written by any replica."""

    model: str
    epoch: int
    """Writes of this model so far (1 = the first); the models file's policy is epoch 0."""
    policy: dict[str, Any]
    by: str
    """Who wrote it (a router replica's id)."""
    reason: str
    """Why: ``set`` (an admin change), ``manual`` (a rollback) or an automatic rollback's reason."""


class RolloutStore:
    """Reads and writes of the shared policies (see the module docstring)."""

    def __init__(self, client: AnyRedis, *, timeout_s: float) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._write = client.register_script(_WRITE)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float) -> RolloutStore:
        client = redis_from_url(url, timeout_s, max_connections=8, client_name="meshserve-rollouts")
        return cls(client, timeout_s=timeout_s)

    async def _bounded(self, call: Any) -> Any:
        try:
            return await asyncio.wait_for(call, self._timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            raise Unavailable(f"{_UNAVAILABLE} ({type(exc).__name__})") from None

    async def read(self, models: Sequence[str]) -> dict[str, StoredPolicy]:
        """The stored policy of each of ``models`` that has one (a malformed entry is logged and skipped)."""
        replies = await self._bounded(self._read(models))
        out: dict[str, StoredPolicy] = {}
        for model, raw in zip(models, replies, strict=True):
            if not raw:
                continue
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            try:
                policy = json.loads(fields["policy"])
                if not isinstance(policy, dict):
                    raise ValueError("not an object")
                out[model] = StoredPolicy(
                    model, int(fields["epoch"]), policy, fields.get("by", ""), fields.get("reason", "")
                )
            except (KeyError, ValueError) as exc:
                log.warning("rollout_store_entry_malformed", model=model, error=str(exc)[:200])
        return out

    async def _read(self, models: Sequence[str]) -> list[Any]:
        async with self._client.pipeline(transaction=False) as pipe:  # one round trip, one connection
            for model in models:
                pipe.hgetall(rollout_key(model))
            return list(await pipe.execute())

    async def write(
        self, model: str, policy: dict[str, Any], *, by: str, reason: str, floor: int = 0, if_missing: bool = False
    ) -> int:
        """Store ``policy`` as ``model``'s next epoch (above the stored one and ``floor``) and announce
        it; returns that epoch. ``if_missing``: only when ``model`` has no stored policy (else 0)."""
        args: list[str | int] = [
            json.dumps(policy),
            by,
            reason,
            f"{time.time():.3f}",
            ROLLOUT_CHANNEL,
            model,
            floor,
            "1" if if_missing else "0",
        ]
        return int(await self._bounded(self._write(keys=[rollout_key(model)], args=args)))

    def notices(self, poll_s: float) -> Notices:
        return Notices(self._client, poll_s, self._timeout_s)

    async def close(self) -> None:
        await self._client.aclose()


class Notices:
    """Announced changes: :meth:`next` returns a model id when one is announced, or None once
    ``poll_s`` has passed without one (then the caller re-reads everything: the fallback when
    pub/sub is missing or was lost). Raises Unavailable when Redis cannot be reached."""

    def __init__(self, client: AnyRedis, poll_s: float, timeout_s: float) -> None:
        self._client = client
        self._poll_s = poll_s
        self._timeout_s = timeout_s
        self._pubsub: Any = None

    async def next(self) -> str | None:
        try:
            if self._pubsub is None:
                self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                await asyncio.wait_for(self._pubsub.subscribe(ROLLOUT_CHANNEL), self._timeout_s)
            message = await asyncio.wait_for(
                self._pubsub.get_message(timeout=self._poll_s), self._poll_s + self._timeout_s
            )
        except (RedisError, OSError, TimeoutError) as exc:
            await self.close()
            raise Unavailable(f"{_UNAVAILABLE} ({type(exc).__name__})") from None
        if message is None or message.get("type") != "message":
            return None
        data = message.get("data")
        return data.decode(errors="replace") if isinstance(data, bytes) else str(data)

    async def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except (RedisError, OSError):
                pass
