"""API keys stored in Redis: created and revoked by ``meshserve keys``, looked up by the gateway.

A key looks like ``msk_<key id>_<secret>``; only its SHA-256 is stored (the plaintext is shown
once, at creation). The record is a Redis hash at :func:`services.store.gateway_keys.api_key_record`
holding the tenant, scopes, policy overrides, creation and expiry times and a revoked flag; a
second key maps the public key id to the digest so ``revoke``/``list`` need no plaintext. Lookup
is by digest, then the stored digest is compared with the presented one in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.cluster import RedisCluster

from services.gateway import scopes as api_scopes
from services.gateway.policy import TenantPolicy
from services.store.connection import AnyRedis
from services.store.gateway_keys import api_key_id, api_key_id_pattern, api_key_record

KEY_PREFIX = "msk_"
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_KEY_ID = re.compile(r"^[0-9a-f]{12}$")


@dataclass(frozen=True)
class KeyRecord:
    """One stored API key (never its plaintext)."""

    key_id: str
    tenant: str
    digest: str
    scopes: tuple[str, ...] = ()
    limits: dict[str, int] = field(default_factory=dict)
    created_at: float = 0.0
    expires_at: float = 0.0
    """Unix time after which the key is refused; 0 = never."""
    revoked: bool = False
    name: str = ""
    models: tuple[str, ...] = ()
    """Model ids the key may use (ListModels shows only these); empty: every served model."""

    def expired(self, now: float | None = None) -> bool:
        return bool(self.expires_at) and (time.time() if now is None else now) >= self.expires_at

    def to_redis(self) -> dict[Any, Any]:
        return {
            "key_id": self.key_id,
            "tenant": self.tenant,
            "digest": self.digest,
            "scopes": ",".join(self.scopes),
            "limits": json.dumps(self.limits, sort_keys=True),
            "created_at": repr(self.created_at),
            "expires_at": repr(self.expires_at),
            "revoked": "1" if self.revoked else "0",
            "name": self.name,
            "models": ",".join(self.models),
        }

    @classmethod
    def from_redis(cls, raw: Mapping[Any, Any]) -> KeyRecord:
        data = {_text(k): _text(v) for k, v in raw.items()}
        return cls(
            key_id=data["key_id"],
            tenant=data["tenant"],
            digest=data["digest"],
            scopes=tuple(s for s in data.get("scopes", "").split(",") if s),
            limits={str(k): int(v) for k, v in json.loads(data.get("limits") or "{}").items()},
            created_at=float(data.get("created_at") or 0),
            expires_at=float(data.get("expires_at") or 0),
            revoked=data.get("revoked") == "1",
            name=data.get("name", ""),
            models=tuple(m for m in data.get("models", "").split(",") if m),
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str | None:
    """The key id embedded in a ``msk_<id>_<secret>`` key, or None for keys of another shape."""
    if not key.startswith(KEY_PREFIX):
        return None
    key_id, _, secret = key[len(KEY_PREFIX) :].partition("_")
    return key_id if _KEY_ID.match(key_id) and secret else None


class KeyStore:
    """Async access to the key records; the same code serves the gateway and the CLI."""

    def __init__(self, client: AnyRedis) -> None:
        self._client = client

    async def create(
        self,
        tenant: str,
        *,
        scopes: Sequence[str] = (),
        limits: Mapping[str, int] | None = None,
        ttl_s: float | None = None,
        name: str = "",
        models: Sequence[str] = (),
    ) -> tuple[str, KeyRecord]:
        """Store a new key; returns ``(plaintext, record)``. The plaintext is never stored.

        ``scopes`` must be known (:mod:`services.gateway.scopes`); none given means ``inference``.
        ``models``: the model ids the key may use (none: every one).
        """
        if not _TENANT.match(tenant):
            raise ValueError("tenant must be 1-64 letters, digits, _ . - (starting with a letter or digit)")
        granted = api_scopes.check_known(scopes) or api_scopes.DEFAULT
        models = tuple(m.strip() for m in models if m.strip())
        for model in models:
            if "," in model or len(model) > 256:
                raise ValueError(f"model id {model[:40]!r} must be at most 256 characters, without commas")
        checked = TenantPolicy().with_overrides(limits)  # raises ValueError naming a bad field
        del checked
        key_id = secrets.token_hex(6)
        plaintext = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        now = time.time()
        record = KeyRecord(
            key_id=key_id,
            tenant=tenant,
            digest=digest_of(plaintext),
            scopes=granted,
            limits=dict(limits or {}),
            created_at=now,
            expires_at=now + ttl_s if ttl_s else 0.0,
            name=name,
            models=models,
        )
        # On Cluster the two keys are in different slots, which MULTI cannot span; without it a crash
        # midway leaves one key: a record whose plaintext nobody was shown, or an id `list` skips.
        cluster = isinstance(self._client, RedisCluster)
        async with self._client.pipeline(transaction=not cluster) as pipe:
            pipe.hset(api_key_record(record.digest), mapping=record.to_redis())
            pipe.set(api_key_id(key_id), record.digest)
            await pipe.execute()
        return plaintext, record

    async def lookup(self, key: str) -> KeyRecord | None:
        """The record of ``key`` (revoked and expired ones included), or None if unknown."""
        presented = digest_of(key)
        raw = await self._client.hgetall(api_key_record(presented))  # type: ignore[misc]
        if not raw:
            return None
        record = KeyRecord.from_redis(raw)
        if not hmac.compare_digest(record.digest.encode(), presented.encode()):
            return None
        return record

    async def get(self, key_id: str) -> KeyRecord | None:
        digest = await self._client.get(api_key_id(key_id))
        if digest is None:
            return None
        raw = await self._client.hgetall(api_key_record(_text(digest)))  # type: ignore[misc]
        return KeyRecord.from_redis(raw) if raw else None

    async def revoke(self, key_id: str) -> bool:
        """Mark the key revoked (the record stays for audit); False if no such key id."""
        record = await self.get(key_id)
        if record is None:
            return False
        await self._client.hset(api_key_record(record.digest), "revoked", "1")  # type: ignore[misc]
        return True

    async def list(self, tenant: str | None = None) -> list[KeyRecord]:
        """Every stored key (of one tenant), oldest first."""
        records: list[KeyRecord] = []
        async for name in self._client.scan_iter(match=api_key_id_pattern(), count=500):
            key_id = _text(name).rsplit(":", 1)[-1]
            record = await self.get(key_id)
            if record is not None and (tenant is None or record.tenant == tenant):
                records.append(record)
        return sorted(records, key=lambda r: r.created_at)
