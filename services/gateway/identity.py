"""Who is calling: one entry point over the three credential sources of the gateway.

A bearer token shaped like a JWT goes to the JWT verifier (when configured). Any other key is
checked against the static keys of ``MESHSERVE_GATEWAY_API_KEYS`` (constant time, every digest
compared), then, if it has the ``msk_<id>_<secret>`` shape, against the Redis key store (through a
short-lived in-process cache, :mod:`services.gateway.keycache`). The result names the tenant, a key
id safe to log (never the key) and the credential's scopes (:mod:`services.gateway.scopes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import structlog
from redis.exceptions import RedisError

from services.common.errors import Unauthenticated, Unavailable
from services.gateway import scopes
from services.gateway.auth import ApiKeyAuthenticator, hash_api_key, presented_key
from services.gateway.jwt_auth import JwtVerifier, looks_like_jwt
from services.gateway.keycache import KeyRecordCache
from services.gateway.keystore import KeyRecord, KeyStore, digest_of, key_id_of

log = structlog.get_logger(__name__)

_MISSING = "missing credentials; send `authorization: Bearer <API key or JWT>` or `x-api-key: <key>` metadata"
_WRONG = "invalid API key; check the key you were given"


@dataclass(frozen=True)
class Identity:
    """An authenticated caller."""

    tenant: str
    key_id: str
    """Loggable id of the credential: ``static:<digest prefix>``, the stored key's id, or ``jwt:<sub>``."""
    source: str
    scopes: tuple[str, ...] = scopes.DEFAULT
    """What the credential may do (:mod:`services.gateway.scopes`); never empty."""
    limits: Mapping[str, int] = field(default_factory=dict)
    """Policy overrides stored on the key (see :mod:`services.gateway.policy`)."""
    models: tuple[str, ...] = ()
    """Model ids the credential may use (:func:`services.gateway.scopes.require_model`); empty: any."""


class Authenticator:
    """Resolves an :class:`Identity` from call metadata, or raises Unauthenticated/Unavailable."""

    def __init__(
        self,
        static: ApiKeyAuthenticator | None = None,
        store: KeyStore | None = None,
        jwt: JwtVerifier | None = None,
        key_cache: KeyRecordCache | None = None,
    ) -> None:
        self._static = static if static is not None and len(static) else None
        self._store = store
        self._jwt = jwt
        self._cache = key_cache

    @property
    def configured(self) -> bool:
        return bool(self._static or self._store or self._jwt)

    async def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Identity:
        token = presented_key(metadata)
        if not token:
            raise Unauthenticated(_MISSING)
        if self._jwt is not None and looks_like_jwt(token):
            claims = self._jwt.verify(token)
            jwt_id = f"jwt:{claims.subject}"
            return Identity(claims.tenant, jwt_id, "jwt", scopes.effective(claims.scopes), models=claims.models)
        if self._static is not None:
            try:
                static = self._static.key_for(token)
            except Unauthenticated:
                pass
            else:
                static_id = f"static:{hash_api_key(token)[:8]}"
                return Identity(static.tenant, static_id, "static", (scopes.ALL,), models=static.models)
        key_id = key_id_of(token)
        if self._store is None or key_id is None:
            raise Unauthenticated(_WRONG)
        record = await self._stored(token)
        if record is None or record.key_id != key_id:
            raise Unauthenticated(_WRONG)
        if record.revoked:
            raise Unauthenticated(f"API key {record.key_id} was revoked; ask for a new key")
        if record.expired():
            raise Unauthenticated(f"API key {record.key_id} has expired; ask for a new key")
        return Identity(
            record.tenant, record.key_id, "keystore", scopes.effective(record.scopes), record.limits, record.models
        )

    async def _stored(self, token: str) -> KeyRecord | None:
        """The stored record of ``token``: from the cache while fresh, else from Redis."""
        assert self._store is not None
        digest = digest_of(token) if self._cache is not None else ""
        if self._cache is not None and (cached := self._cache.get(digest)) is not None:
            return cached
        try:
            record = await self._store.lookup(token)
        except (RedisError, OSError) as exc:
            log.warning("key_store_unreachable", error=type(exc).__name__)
            raise Unavailable("cannot check the API key right now (key store unreachable); retry shortly") from None
        if record is not None and self._cache is not None:
            self._cache.put(digest, record)
        return record
